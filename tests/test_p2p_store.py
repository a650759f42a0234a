"""The P2P store in one process: several nodes, each with its own engine, on one metadata
service. Manifests, version pinning, resume verification, leases, caps, corrupt holders,
state_dicts and safetensors checks (the multi-process cases are in integration_tests)."""

from __future__ import annotations

import json
import os
import struct
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import wait_until

from mooncake_connectors.config import EngineConfig
from mooncake_connectors.errors import ConfigError
from mooncake_connectors.p2p import FetchFailed, ObjectNotFound, P2PError, P2PStore
from mooncake_connectors.p2p.manifest import (
    ChunkEntry,
    build_manifest,
    decode_manifest,
    encode_manifest,
)
from mooncake_connectors.p2p.records import Catalog, HolderRecord
from mooncake_connectors.p2p.safetensors import check_checkpoint, fetch_checkpoint, read_header

CHUNK = 64 << 10


@pytest.fixture
def cfg() -> EngineConfig:
    return EngineConfig(metadata=f"memory://p2p-{uuid.uuid4().hex}")


@pytest.fixture
def nodes(cfg: EngineConfig) -> Iterator[list[P2PStore]]:
    made: list[P2PStore] = []
    yield made
    for n in made:
        n.close()


def node(nodes: list[P2PStore], cfg: EngineConfig, **kw: object) -> P2PStore:
    n = P2PStore(cfg, **kw)  # type: ignore[arg-type]
    nodes.append(n)
    return n


def tree(root: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    (root / "sub").mkdir(parents=True)
    (root / "a.bin").write_bytes(rng.bytes(5 * CHUNK + 123))
    (root / "sub" / "b.bin").write_bytes(rng.bytes(CHUNK))
    (root / "empty").write_bytes(b"")
    return root


def same(a: Path, b: Path) -> bool:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    return all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


def test_manifest_round_trip_and_checks() -> None:
    data = memoryview(bytes(range(256)) * 10)
    m = build_manifest("x", 1, [("f", data, "", [])], chunk_size=1000)
    assert [c.length for c in m.chunks] == [1000, 1000, 560]
    assert decode_manifest(encode_manifest(m)) == m
    for bad in (
        m.__class__(
            m.name, 1, 1000, m.total_size, [m.files[0].__class__("../f", 2560, 0)], m.chunks
        ),
        m.__class__(m.name, 1, 1000, m.total_size + 1, m.files, m.chunks),
        m.__class__(
            m.name,
            1,
            1000,
            m.total_size,
            m.files,
            [*m.chunks[:2], ChunkEntry(0, 2001, 559, m.chunks[2].sha256)],
        ),
    ):
        with pytest.raises(P2PError):
            decode_manifest(encode_manifest(bad))
    with pytest.raises(P2PError):
        decode_manifest(b"{not json")
    with pytest.raises(ConfigError):
        build_manifest("bad/name", 1, [], 10)


def test_fetch_is_byte_identical_and_served_onward(
    tmp_path: Path, cfg: EngineConfig, nodes: list[P2PStore]
) -> None:
    src = tree(tmp_path / "src")
    pub = node(nodes, cfg)
    m = pub.publish("ckpt", [src], chunk_size=CHUNK)
    assert (m.version, len(m.files), len(m.chunks)) == (1, 3, 7)
    a, b = node(nodes, cfg), node(nodes, cfg)
    sa = a.fetch("ckpt", tmp_path / "a")
    assert sa.fetched == 7 and sa.verified == 0 and same(src, tmp_path / "a")
    sb = b.fetch("ckpt", tmp_path / "b")
    assert same(src, tmp_path / "b")
    assert sum(sb.from_holder.values()) == m.total_size
    assert pub.holder_counts("ckpt", 1) == [3] * 7  # both fetchers hold and serve every chunk
    info = pub.ls()[0]
    assert (info.name, info.version, info.holders, info.complete_holders) == ("ckpt", 1, 3, 3)


def test_republish_is_a_new_version_and_fetches_pin_one(
    tmp_path: Path, cfg: EngineConfig, nodes: list[P2PStore]
) -> None:
    v1 = tree(tmp_path / "v1", seed=1)
    v2 = tree(tmp_path / "v2", seed=2)
    p1, p2 = node(nodes, cfg), node(nodes, cfg)
    assert p1.publish("m", v1, chunk_size=CHUNK).version == 1
    assert p2.publish("m", v2, chunk_size=CHUNK).version == 2
    f = node(nodes, cfg)
    assert f.fetch("m", tmp_path / "new").version == 2 and same(v2, tmp_path / "new")
    assert f.fetch("m", tmp_path / "old", version=1).version == 1 and same(v1, tmp_path / "old")
    with pytest.raises(ObjectNotFound):
        f.fetch("m", tmp_path / "x", version=3)


def test_resume_reverifies_and_refetches_only_bad_chunks(
    tmp_path: Path, cfg: EngineConfig, nodes: list[P2PStore]
) -> None:
    src = tree(tmp_path / "src")
    pub = node(nodes, cfg)
    pub.publish("r", src, chunk_size=CHUNK)
    dst = tmp_path / "dst"
    first = node(nodes, cfg)
    first.fetch("r", dst)
    first.close()
    nodes.remove(first)
    with open(dst / "a.bin", "r+b") as fh:  # one chunk damaged, as a crash mid-write leaves it
        fh.seek(2 * CHUNK + 7)
        fh.write(b"\xff\xfe")
    again = node(nodes, cfg).fetch("r", dst)
    assert (again.verified, again.fetched) == (6, 1)
    assert same(src, dst)


def test_leases_forget_silent_holders(cfg: EngineConfig, nodes: list[P2PStore]) -> None:
    n = node(nodes, cfg)
    cat = Catalog(n.engine.metadata)  # type: ignore[arg-type]
    now = time.time()
    cat.put_holder("o", 1, HolderRecord("alive", "h:1", "s", b"\x01", now, 5.0))
    cat.put_holder("o", 1, HolderRecord("dead", "h:2", "s", b"\x01", now - 6.0, 5.0))
    assert [r.holder for r in cat.holders("o", 1, now=now)] == ["alive"]
    assert [r.holder for r in cat.holders("o", 1, now=now)] == ["alive"]  # and deleted
    assert cat.holders("o", 1, now=now + 10) == []


def test_closed_holder_withdraws_and_unpublish_stops_holders(
    tmp_path: Path, cfg: EngineConfig, nodes: list[P2PStore]
) -> None:
    src = tree(tmp_path / "src")
    pub = node(nodes, cfg, lease=0.6)
    pub.publish("u", src, chunk_size=CHUNK)
    f = node(nodes, cfg)
    f.fetch("u", tmp_path / "d")
    assert pub.ls()[0].holders == 2
    f.close()
    nodes.remove(f)
    assert pub.ls()[0].holders == 1
    assert pub.unpublish("u") >= 3
    with pytest.raises(ObjectNotFound):
        node(nodes, cfg).fetch("u", tmp_path / "e")
    wait_until(lambda: not pub.holder.objects, 5.0, "the publisher to drop the unpublished object")
    assert pub.ls() == []


def test_serve_cap_per_peer(tmp_path: Path, cfg: EngineConfig, nodes: list[P2PStore]) -> None:
    src = tree(tmp_path / "src")
    pub = node(nodes, cfg, serve_cap=2 * CHUNK)
    pub.publish("c", src, chunk_size=CHUNK)
    with pytest.raises(FetchFailed, match="chunks missing"):
        node(nodes, cfg).fetch("c", tmp_path / "d", timeout=1.5)
    # The cap is never exceeded, and the fetcher asked until no chunk it lacked fit (the order
    # is random: a full chunk and the 123-byte tail leave no room for another full one).
    served = pub.holder.ledger.served
    assert len(served) == 1 and CHUNK < max(served.values()) <= 2 * CHUNK


def test_corrupt_holder_is_bypassed(
    tmp_path: Path, cfg: EngineConfig, nodes: list[P2PStore]
) -> None:
    src = tree(tmp_path / "src")
    pub = node(nodes, cfg)
    pub.publish("z", src, chunk_size=CHUNK)
    bad = node(nodes, cfg)
    bad.fetch("z", tmp_path / "bad")
    for name in ("a.bin", "sub/b.bin"):  # it now serves only wrong bytes
        f = tmp_path / "bad" / name
        with open(f, "r+b") as fh:
            fh.write(os.urandom(f.stat().st_size))
    # One request in flight per holder: the first round asks both, so the bad one is asked.
    stats = node(nodes, cfg).fetch("z", tmp_path / "good", k=1, parallel=2)
    assert same(src, tmp_path / "good")
    assert stats.corrupt >= 1
    bad_holder = next(iter(bad.holder.objects.values())).holder
    assert bad_holder not in stats.from_holder  # not one chunk was kept from it


def test_state_dict_into_preallocated_buffers(cfg: EngineConfig, nodes: list[P2PStore]) -> None:
    sd = {
        "layer.0.w": np.arange(40_000, dtype=np.float32).reshape(200, 200),
        "layer.0.b": np.arange(200, dtype=np.float16),
        "none": np.zeros(0, dtype=np.float32),
    }
    m = node(nodes, cfg).publish("sd", sd, chunk_size=CHUNK)
    assert {f.path: (f.dtype, f.shape) for f in m.files}["layer.0.w"] == ("float32", [200, 200])
    out = {k: np.zeros_like(v) for k, v in sd.items()}
    node(nodes, cfg).fetch("sd", out)
    for k in sd:
        assert np.array_equal(out[k], sd[k])
    with pytest.raises(ConfigError, match="holds"):
        node(nodes, cfg).fetch("sd", {**out, "layer.0.b": np.zeros(3, dtype=np.float16)})


def test_p2p_metadata_is_refused() -> None:
    with pytest.raises(ConfigError, match="metadata"):
        P2PStore(EngineConfig(metadata="p2p"))


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    head: dict[str, object] = {"__metadata__": {"format": "pt"}}
    off, blobs = 0, []
    names = {np.dtype("float32"): "F32", np.dtype("float16"): "F16"}
    for k, a in tensors.items():
        b = a.tobytes()
        head[k] = {
            "dtype": names[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [off, off + len(b)],
        }
        off += len(b)
        blobs.append(b)
    raw = json.dumps(head).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def test_safetensors_checkpoint(tmp_path: Path, cfg: EngineConfig, nodes: list[P2PStore]) -> None:
    ck = tmp_path / "ck"
    ck.mkdir()
    write_safetensors(ck / "model-00001-of-00002.safetensors", {"a": np.ones((64, 64), np.float32)})
    write_safetensors(ck / "model-00002-of-00002.safetensors", {"b": np.ones(300, np.float16)})
    (ck / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "weight_map": {
                    "a": "model-00001-of-00002.safetensors",
                    "b": "model-00002-of-00002.safetensors",
                }
            }
        )
    )
    (ck / "config.json").write_text("{}")
    info = read_header(ck / "model-00001-of-00002.safetensors")["a"]
    assert (info.dtype, info.shape, info.end - info.start) == ("F32", (64, 64), 64 * 64 * 4)
    node(nodes, cfg).publish("ck", ck, chunk_size=4096)
    stats = fetch_checkpoint(node(nodes, cfg), "ck", tmp_path / "model")
    assert stats.fetched == stats.chunks and same(ck, tmp_path / "model")
    assert check_checkpoint(tmp_path / "model") == {
        "model-00001-of-00002.safetensors": 1,
        "model-00002-of-00002.safetensors": 1,
    }
    bad = tmp_path / "model" / "model-00002-of-00002.safetensors"
    bad.write_bytes(bad.read_bytes()[:-10])  # truncated: the tensor runs past the end
    with pytest.raises(P2PError, match="past the end"):
        check_checkpoint(tmp_path / "model")
    bad.unlink()
    with pytest.raises(P2PError, match="not here"):
        check_checkpoint(tmp_path / "model")


def test_grants_need_the_token(tmp_path: Path, nodes: list[P2PStore]) -> None:
    from mooncake_connectors.p2p.serve import Grant, GrantClient, Have

    cfg = EngineConfig(metadata=f"memory://p2p-{uuid.uuid4().hex}", auth_token="p2p-secret-1")
    src = tree(tmp_path / "src")
    pub = node(nodes, cfg)
    pub.publish("t", src, chunk_size=CHUNK)
    assert node(nodes, cfg).fetch("t", tmp_path / "d").fetched == 7
    ep = pub.holder.endpoint
    wrong, none, right = (GrantClient(t, 5.0) for t in ("not-the-token", None, "p2p-secret-1"))
    try:
        assert wrong.ask(ep, Grant("t", 1, 0, "x")).status == "refused"  # type: ignore[union-attr]
        assert none.ask(ep, Have("t", 1)).status == "refused"  # type: ignore[union-attr]
        ok = right.ask(ep, Grant("t", 1, 0, "x"))
        assert ok is not None and ok.status == "ok" and ok.length == CHUNK
        assert right.ask(ep, Grant("t", 1, 99, "x")).status == "missing"  # type: ignore[union-attr]
        assert right.ask(ep, Grant("t", 2, 0, "x")).status == "missing"  # type: ignore[union-attr]
    finally:
        for c in (wrong, none, right):
            c.close()


def test_grant_server_survives_garbage(
    tmp_path: Path, cfg: EngineConfig, nodes: list[P2PStore]
) -> None:
    import zmq

    from mooncake_connectors.p2p.serve import Grant, GrantClient

    pub = node(nodes, cfg)
    pub.publish("g", tree(tmp_path / "src"), chunk_size=CHUNK)
    ep = pub.holder.endpoint
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"tcp://{ep}")
    try:
        raw.send_multipart([b"", b"", b"\xc1\xff not msgpack"])  # a REQ envelope, bad body
        assert raw.poll(5000) and b"refused" in raw.recv_multipart()[-1]
        raw.send_multipart([b"no envelope"])  # not a REQ frame: dropped, nothing to answer
        raw.send_multipart([b"", b"", os.urandom(1 << 16)])
        assert raw.poll(5000) and b"refused" in raw.recv_multipart()[-1]
    finally:
        raw.close(linger=0)
    ok = GrantClient(None, 5.0)
    try:
        got = ok.ask(ep, Grant("g", 1, 0, "x"))
        assert got is not None and got.status == "ok"
    finally:
        ok.close()


def test_torch_state_dict_round_trip(cfg: EngineConfig, nodes: list[P2PStore]) -> None:
    torch = pytest.importorskip("torch")
    sd = {"emb": torch.randn(300, 64), "norm": torch.ones(64, dtype=torch.bfloat16)}
    m = node(nodes, cfg).publish("t", sd, chunk_size=CHUNK)
    assert {f.path: f.dtype for f in m.files} == {"emb": "torch.float32", "norm": "torch.bfloat16"}
    out = {k: torch.empty_like(v) for k, v in sd.items()}
    node(nodes, cfg).fetch("t", out)
    assert all(torch.equal(out[k], sd[k]) for k in sd)

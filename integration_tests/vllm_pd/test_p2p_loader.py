"""vLLM's own loader registry resolves ``load_format="mooncake_p2p"`` (through our
``vllm.general_plugins`` entry point) to a loader that fetches the checkpoint from a real
publisher in this process, verifies it, and hands vLLM's default loader a directory it accepts."""

from __future__ import annotations

import json
import struct
import types
import uuid
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm.config import LoadConfig
from vllm.model_executor.model_loader import get_model_loader
from vllm.plugins import load_general_plugins

from mooncake_connectors.config import EngineConfig
from mooncake_connectors.errors import ConfigError
from mooncake_connectors.p2p import P2PStore


def safetensors(path: Path, arr: np.ndarray) -> None:
    head = json.dumps(
        {"w": {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [0, arr.nbytes]}}
    ).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + arr.tobytes())


def test_mooncake_p2p_load_format_fetches_then_loads(tmp_path: Path) -> None:
    load_general_plugins()
    src = tmp_path / "src"
    src.mkdir()
    safetensors(src / "model.safetensors", np.arange(4096, dtype=np.float32))
    (src / "config.json").write_text("{}")
    md = f"memory://vllm-p2p-{uuid.uuid4().hex}"
    with P2PStore(EngineConfig(metadata=md)) as pub:
        pub.publish("tiny", src, chunk_size=4096)
        loader = get_model_loader(
            LoadConfig(
                load_format="mooncake_p2p",
                model_loader_extra_config={"p2p_name": "tiny", "p2p_metadata": md},
            )
        )
        dest = tmp_path / "model"
        try:
            loader.download_model(types.SimpleNamespace(model=str(dest), revision=None))
        finally:
            loader.close()
    assert (dest / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    with pytest.raises(ConfigError, match="p2p_name"):
        get_model_loader(LoadConfig(load_format="mooncake_p2p"))

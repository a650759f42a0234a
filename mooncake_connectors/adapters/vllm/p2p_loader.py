"""``load_format="mooncake_p2p"``: vLLM loads a checkpoint it first fetches from the P2P swarm.

    vllm serve /models/llama --load-format mooncake_p2p \
        --model-loader-extra-config '{"p2p_name": "llama", "p2p_metadata": "http://10.0.0.1:8080/metadata"}'

``--model`` names the local directory the checkpoint goes to. vLLM reads the model's
``config.json`` from it before any loader runs, so that file (and the tokenizer's) must be there
already; the loader then fetches the published object into the same directory (files already
there are verified by hash, not fetched again) and hands over to vLLM's default safetensors
loader. With several workers on one host, one fetches while the others wait on a file lock and
then only verify. The fetched chunks are served onward to other instances until the worker exits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
from pathlib import Path
from typing import Any

from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from ...errors import ConfigError, PluginError

LOAD_FORMAT = "mooncake_p2p"
_KEYS = ("p2p_name", "p2p_metadata", "p2p_version", "p2p_timeout", "p2p_host")


class P2PModelLoader(DefaultModelLoader):  # type: ignore[misc]
    def __init__(self, load_config: Any) -> None:
        extra = dict(load_config.model_loader_extra_config or {})
        self.p2p = {k: extra.pop(k) for k in _KEYS if k in extra}
        if not isinstance(self.p2p.get("p2p_name"), str):
            raise ConfigError(
                f"load_format={LOAD_FORMAT!r} needs model_loader_extra_config "
                '{"p2p_name": NAME, "p2p_metadata": URL}',
                field="p2p_name",
            )
        # The default loader refuses keys it does not know and formats it cannot read.
        plain = dataclasses.replace(
            load_config, load_format="safetensors", model_loader_extra_config=extra
        )
        super().__init__(plain)
        self._node: Any = None

    def _fetch(self, model_dir: str) -> None:
        from ...config import engine_config_from_env
        from ...p2p import P2PStore
        from ...p2p.safetensors import fetch_checkpoint

        dest = Path(model_dir)
        dest.mkdir(parents=True, exist_ok=True)
        over: dict[str, object] = {}
        if self.p2p.get("p2p_metadata"):
            over["metadata"] = str(self.p2p["p2p_metadata"])
        if self.p2p.get("p2p_host"):
            over["host"] = str(self.p2p["p2p_host"])
        with open(dest / ".mooncake-p2p.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # workers of one host take turns; the later verify
            if self._node is None:
                self._node = P2PStore(engine_config_from_env(None, **over))
            version = self.p2p.get("p2p_version")
            fetch_checkpoint(
                self._node,
                str(self.p2p["p2p_name"]),
                dest,
                version=int(version) if version is not None else None,
                timeout=float(self.p2p.get("p2p_timeout", 3600.0)),
            )

    def download_model(self, model_config: Any) -> None:
        self._fetch(model_config.model)
        super().download_model(model_config)

    def load_weights(self, model: Any, model_config: Any) -> None:
        self._fetch(model_config.model)
        super().load_weights(model, model_config)

    def close(self) -> None:
        """Stop serving the fetched chunks (vLLM never calls this; process exit does it)."""
        if self._node is not None:
            with contextlib.suppress(Exception):
                self._node.close()
            self._node = None


def register() -> None:
    """Make ``load_format="mooncake_p2p"`` known to vLLM (idempotent)."""
    from vllm.model_executor import model_loader

    held = model_loader._LOAD_FORMAT_TO_MODEL_LOADER.get(LOAD_FORMAT)
    if held is P2PModelLoader:
        return
    if held is not None:
        raise PluginError(
            f"vLLM load format {LOAD_FORMAT!r} is already taken by "
            f"{held.__module__}.{held.__name__}"
        )
    model_loader.register_model_loader(LOAD_FORMAT)(P2PModelLoader)


__all__ = ["LOAD_FORMAT", "P2PModelLoader", "register"]

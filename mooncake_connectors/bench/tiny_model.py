"""Build a tiny random Llama with a byte-level BPE tokenizer, locally and repeatably.

For tests, benchmarks and demos on machines without a model hub: a BPE tokenizer trained on the
standard library's Python sources and a randomly initialised ``LlamaForCausalLM`` saved in bf16
(2 layers, hidden 256, 4 heads, 2 KV heads of 64: about 1.7 M parameters, 1 KiB of KV per token).
The seed is fixed, so two builds give the same weights. Needs ``transformers`` and ``tokenizers``
(both come with vLLM).

    python -m mooncake_connectors.bench.tiny_model OUT_DIR [LAYERS KV_HEADS]

:func:`build_gemma3` writes a tiny random Gemma 3 (text only) the same way: 3 sliding-window
layers (a 64-token window) and 1 full-attention layer, which vLLM's hybrid KV cache manager
serves with 4 KV cache groups.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

VOCAB = 1024
MAX_POSITIONS = 10240  # room for the benchmark's 8k-token prompts
SEED = 1234
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def corpus_files(limit: int = 200) -> list[str]:
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [str(p) for p in sorted(stdlib.glob("*.py"))[:limit]]


def build(
    out: Path, *, layers: int = 2, kv_heads: int = 2, hidden: int = 256, dtype: str = "bfloat16"
) -> Path:
    """Write the model into ``out`` (created) and return it; a finished build is reused.
    ``hidden``: the hidden size (64-wide heads, MLP twice as wide); ``dtype``: of the saved
    weights and the config (``bfloat16`` or ``float32``)."""
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    import importlib

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tf: Any = importlib.import_module("transformers")  # its stubs lag its API; used untyped

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(corpus_files(), trainer)
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.model_max_length = MAX_POSITIONS
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))

    torch.manual_seed(SEED)
    cfg = tf.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, kv_heads),
        num_key_value_heads=kv_heads,
        head_dim=64,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        dtype=dtype,
    )
    model = tf.LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def build_gemma3(out: Path, *, window: int = 64) -> Path:
    """A tiny random Gemma 3: 4 layers (sliding, sliding, sliding, full), hidden 256, 4 heads,
    2 KV heads of 64, the Llama's tokenizer; a finished build is reused."""
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    import importlib
    import shutil

    import torch

    tf: Any = importlib.import_module("transformers")
    llama = build(out.parent / f"{out.name}-tokenizer")  # the same tokenizer, trained once
    out.mkdir(parents=True, exist_ok=True)
    for f in llama.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    fast = tf.PreTrainedTokenizerFast.from_pretrained(str(llama))
    torch.manual_seed(SEED)
    cfg = tf.Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=window,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.eos_token_id,
        tie_word_embeddings=True,
        dtype="bfloat16",
    )
    model = tf.Gemma3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


if __name__ == "__main__":
    shape = [int(a) for a in sys.argv[2:4]] + [2, 2][len(sys.argv[2:4]) :]
    print(build(Path(sys.argv[1]), layers=shape[0], kv_heads=shape[1]))

"""Build a tiny random Llama with a byte-level BPE tokenizer, locally and repeatably.

For tests, benchmarks and demos on machines without a model hub: a BPE tokenizer trained on the
standard library's Python sources and a randomly initialised ``LlamaForCausalLM`` saved in bf16
(2 layers, hidden 256, 4 heads, 2 KV heads of 64: about 1.7 M parameters, 1 KiB of KV per token).
The seed is fixed, so two builds give the same weights. Needs ``transformers`` and ``tokenizers``
(both come with vLLM).

    python -m mooncake_connectors.bench.tiny_model OUT_DIR [LAYERS KV_HEADS]
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


if __name__ == "__main__":
    shape = [int(a) for a in sys.argv[2:4]] + [2, 2][len(sys.argv[2:4]) :]
    print(build(Path(sys.argv[1]), layers=shape[0], kv_heads=shape[1]))

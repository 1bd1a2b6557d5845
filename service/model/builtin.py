"""The built-in default model: a small Llama written once in the Hugging Face layout.

So the service runs with no download, the default model is generated deterministically
(seeded weights) into a cache folder as ``config.json``, ``model.safetensors`` and a byte-level
``tokenizer.json``, and then loaded by the same loader as any real checkpoint.

Shape: vocab 384 (256 bytes, <s> = 256, </s> = 257, the rest unused), hidden 256, 4 layers,
8 query heads and 4 KV heads of dim 32, SwiGLU intermediate 768, RMSNorm eps 1e-5, rope theta
10000, 8192 positions, untied LM head; about 3.5 M parameters. Head counts divide tp 1, 2 and 4.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

BUILTIN_NAME = "builtin-llama-3m"
BUILTIN_VERSION = 2  # 2: tokenizer_config.json with a chat template
BOS_ID, EOS_ID = 256, 257

BUILTIN_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 384,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "torch_dtype": "float32",
}


# A small chat template, so that /v1/chat/completions works on the built-in model: one line per
# message, "<role>: <content>", then "assistant:" for the reply.
BUILTIN_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
BUILTIN_TOKENIZER_CONFIG = {
    "bos_token": "<s>",
    "eos_token": "</s>",
    "chat_template": BUILTIN_CHAT_TEMPLATE,
}


def cache_root() -> Path:
    return Path(os.environ.get("CAPTURE_SERVICE_CACHE", Path.home() / ".cache" / "capture-service"))


def builtin_model_dir() -> Path:
    """The built-in checkpoint's folder, written on first use (atomically: ranks may race)."""
    target = cache_root() / f"{BUILTIN_NAME}-v{BUILTIN_VERSION}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".builtin-", dir=target.parent))
    try:
        write_builtin(tmp)
        with contextlib.suppress(OSError):  # another process won the race; same bytes
            tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_builtin(out: Path, seed: int = 1234) -> None:
    import torch
    from safetensors.torch import save_file

    from service.model.arch_config import parse_arch_config
    from service.model.llama import CausalLM
    from service.model.loader import init_random
    from service.model.parallel import TPGroup

    cfg = parse_arch_config(BUILTIN_CONFIG)
    model = CausalLM(cfg, TPGroup(), cfg.max_position_embeddings)
    init_random(model, seed)
    tensors: dict[str, torch.Tensor] = {}
    q, kv = cfg.q_size, cfg.kv_size
    i = cfg.intermediate_size
    for name, p in model.named_parameters():
        data = p.detach().contiguous()
        if ".qkv_proj." in name:
            base = "model." + name.replace("qkv_proj.weight", "")
            tensors[base + "q_proj.weight"] = data[:q].clone()
            tensors[base + "k_proj.weight"] = data[q : q + kv].clone()
            tensors[base + "v_proj.weight"] = data[q + kv :].clone()
        elif ".gate_up_proj." in name:
            base = "model." + name.replace("gate_up_proj.weight", "")
            tensors[base + "gate_proj.weight"] = data[:i].clone()
            tensors[base + "up_proj.weight"] = data[i:].clone()
        elif name.startswith("lm_head."):
            tensors[name] = data.clone()
        else:
            tensors["model." + name] = data.clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(BUILTIN_CONFIG, indent=2))
    write_byte_tokenizer(out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps(BUILTIN_TOKENIZER_CONFIG, indent=2))


def write_byte_tokenizer(path: Path) -> None:
    """A byte-level tokenizer: every UTF-8 byte is one token, plus <s> and </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of)
    vocab = {ch: idx for idx, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(path))


def _byte_of(ch: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's bytes_to_unicode)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return bs[cs.index(ord(ch))]

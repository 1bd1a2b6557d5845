"""A small bf16 model directory whose head dim FlashInfer supports (128), from config.json alone.

Weights come from ``--load-format random`` (the loader's seeded init); the byte tokenizer of the
built-in model is copied in so that text prompts work through the API.
"""

from __future__ import annotations

import json
from pathlib import Path

from service.model.builtin import BUILTIN_CONFIG, write_byte_tokenizer

FI_CONFIG = {
    **BUILTIN_CONFIG,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "torch_dtype": "bfloat16",
}


def write_fi_model(out: Path, **overrides: object) -> Path:
    """The model directory at ``out``; ``overrides``: config.json fields changed (e.g. Qwen2's
    ``attention_bias=True``)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**FI_CONFIG, **overrides}, indent=1))
    write_byte_tokenizer(out / "tokenizer.json")
    return out

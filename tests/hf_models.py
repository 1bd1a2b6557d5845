"""Tiny random checkpoints made with Hugging Face transformers, saved as real HF folders."""

from __future__ import annotations

from pathlib import Path

import torch

# Shape shared by both tiny checkpoints; large init so greedy choices are not near-ties.
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)


def make_llama(
    out: Path, *, tied: bool = False, rope_scaling: dict | None = None, shard: bool = False
):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        **TINY,
        intermediate_size=128,
        rope_theta=5000.0,
        rope_scaling=rope_scaling,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out, max_shard_size="100KB" if shard else "10GB")
    return model


def make_qwen2(out: Path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen2Config(
        **TINY, intermediate_size=96, rope_theta=1_000_000.0, tie_word_embeddings=True
    )
    model = Qwen2ForCausalLM(cfg).eval()
    model.save_pretrained(out)
    return model


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """(len(ids), V) float32 logits of the HF model over one sequence."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()

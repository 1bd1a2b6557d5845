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


# DeepSeek shapes scaled down: MLA with YaRN, routed + shared experts after one dense layer.
# Widths are multiples of 4 (the grouped GEMM's 16-byte strides in float32).
DEEPSEEK_TINY = dict(
    TINY,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)


def make_deepseek_v2(out: Path):
    """V2-Lite's structure: a plain q projection, softmax greedy routing."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(2)
    cfg = DeepseekV2Config(**DEEPSEEK_TINY, q_lora_rank=None, topk_method="greedy")
    model = DeepseekV2ForCausalLM(cfg).eval()
    model.save_pretrained(out)
    return model


def make_deepseek_v3(out: Path):
    """V3's structure: q LoRA, sigmoid routing with a correction bias over expert groups,
    normalised and scaled weights."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(3)
    cfg = DeepseekV3Config(
        **DEEPSEEK_TINY,
        q_lora_rank=24,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():  # a non-zero bias, so that choosing by it (not by weight) is tested
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.1)
    model.save_pretrained(out)
    return model

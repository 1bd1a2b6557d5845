"""Our model, loader and engine against Hugging Face transformers on real saved checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from service.config import EngineConfig, GraphConfig
from service.engine import Engine
from service.errors import CheckpointError, RequestError
from service.sampling import SamplingParams
from tests.hf_models import (
    hf_logits,
    make_deepseek_v2,
    make_deepseek_v3,
    make_llama,
    make_qwen2,
)

TOL = 1e-4


@pytest.fixture(
    scope="module",
    params=["llama", "llama_sharded_llama3rope", "qwen2", "deepseek_v2", "deepseek_v3"],
)
def checkpoint(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        model = make_llama(out)
    elif request.param == "llama_sharded_llama3rope":
        model = make_llama(
            out,
            shard=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        assert (out / "model.safetensors.index.json").is_file()
    elif request.param == "qwen2":
        model = make_qwen2(out)
    else:  # MLA + MoE (more of the family in tests/test_deepseek.py)
        model = (make_deepseek_v2 if request.param == "deepseek_v2" else make_deepseek_v3)(out)
    return out, model


def engine_for(path, **kw) -> Engine:
    cfg = EngineConfig(
        model_path=str(path),
        dtype="float32",
        device="cpu",
        context_length=kw.pop("context_length", 256),
        graph=GraphConfig(backend="eager"),
        kv_cache_memory_bytes=8 << 20,
        **kw,
    )
    engine = Engine(cfg)
    engine.return_logits = True
    return engine


PROMPTS = [[5, 17, 99, 3, 250, 8, 8, 1], [42] * 3, list(range(10, 60)), [7]]


def test_prefill_of_several_requests_matches(checkpoint):
    path, hf = checkpoint
    engine = engine_for(path)
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=1))
    ((batch, result),) = engine.last_logits
    assert batch.command.is_prefill and len(batch.requests) == len(PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        ref = hf_logits(hf, prompt)[-1]
        assert (result.logits[i] - ref).abs().max().item() < TOL


def test_chunked_prefill_and_decode_match(checkpoint):
    path, hf = checkpoint
    engine = engine_for(path, chunked_prefill_size=16)  # the 50-token prompt takes 4 chunks
    prompt = PROMPTS[2]
    (out,) = engine.generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True))
    prefills = [b for b, _ in engine.last_logits if b.command.is_prefill]
    assert [b.command.extend_lens[0] for b in prefills] == [16, 16, 16, 2]
    assert len(out.meta_info["prefill_batches"]) == 4
    full = prompt + out.output_ids
    ref = hf_logits(hf, full)
    pos = len(prompt) - 1
    for batch, result in engine.last_logits:
        if batch.command.is_prefill and batch.command.prefix_lens[0] + 16 < len(prompt):
            continue  # partial chunks sample nothing useful
        assert (result.logits[0] - ref[pos]).abs().max().item() < TOL, pos
        pos += 1
    assert pos == len(full) - 1


def test_greedy_generation_matches_hf_generate(checkpoint):
    path, hf = checkpoint
    engine = engine_for(path)
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8
            )[0, len(prompt) :].tolist()
        assert out.output_ids == ref


def test_prompt_longer_than_context_is_refused(checkpoint):
    path, _ = checkpoint
    engine = engine_for(path, context_length=32)
    with pytest.raises(RequestError, match="33 tokens, more than the context length 32"):
        engine.generate([[1] * 33])
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.generate([[1, 999]])
    # the engine still serves after refusing
    (out,) = engine.generate([[1] * 32], SamplingParams(max_new_tokens=4))
    assert out.meta_info["finish_reason"]["type"] == "length"
    assert len(out.output_ids) == 1  # a full-context prompt has room for exactly one token


def test_loader_errors_name_what_is_wrong(tmp_path, checkpoint):
    path, _ = checkpoint
    with pytest.raises(CheckpointError, match=r"config\.json not found"):
        engine_for(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    bad = tmp_path / "bad_arch"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["MambaForCausalLM"]}))
    with pytest.raises(CheckpointError, match="unsupported architecture"):
        engine_for(bad)
    nowt = tmp_path / "no_weights"
    nowt.mkdir()
    (nowt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        engine_for(nowt)
    wrong = tmp_path / "wrong_shape"
    wrong.mkdir()
    (wrong / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 80}))
    for f in path.glob("*.safetensors*"):
        (wrong / f.name).write_bytes(f.read_bytes())
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.0\.mlp\..*expected shape"):
        engine_for(wrong)

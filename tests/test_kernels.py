"""The model's elementwise kernels: the torch reference keeps the original results on CPU, and
FlashInfer's fused kernels match it on CUDA (gpu marker), with the choice reported."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from service.config import EngineConfig, GraphConfig
from service.engine import Engine
from service.errors import ConfigError
from service.model.kernels import Kernels
from service.ranks.select import choose_kernels
from service.sampling import SamplingParams
from tests.batches import cpu_server_info

GOLDEN = Path(__file__).parent / "data" / "builtin_golden.json"


def test_the_torch_kernels_keep_the_results_of_the_unfused_model():
    """tests/data/builtin_golden.json was written by the model before the fused-kernel rework
    (the commit before it, same script): greedy tokens equal, prefill logits within 1e-5."""
    golden = json.loads(GOLDEN.read_text())
    eager = GraphConfig(backend="eager")
    cfg = EngineConfig(device="cpu", dtype="float32", context_length=256,
                       kv_cache_memory_bytes=16 << 20, graph=eager)  # fmt: skip
    e = Engine(cfg)
    assert e.resolved.limits.kernels.name == "torch"
    e.return_logits = True
    prompts = [[(7 * i + 3) % 256 for i in range(n)] for n in (1, 17, 100)]
    outs = e.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert [o.output_ids for o in outs] == golden["output_ids"]
    logits = e.last_logits[0][1].logits
    for i, hexed in enumerate(golden["prefill_logits_hex"]):
        want = torch.from_numpy(np.frombuffer(bytes.fromhex(hexed), dtype=np.float32).copy())
        assert (logits[i] - want).abs().max().item() < 1e-5


def test_kernel_choice_says_why_and_refuses_what_cannot_run():
    assert choose_kernels("auto", "cuda", "bfloat16", 128, None).name == "flashinfer"
    cpu = choose_kernels("auto", "cpu", "float32", 128, None)
    assert cpu.name == "torch" and "CUDA device" in cpu.reason
    assert "--fused-kernels torch" in choose_kernels("torch", "cuda", "bfloat16", 128, None).reason
    with pytest.raises(ConfigError, match=r"--fused-kernels flashinfer cannot run here: .*gpu"):
        choose_kernels("flashinfer", "cuda", "bfloat16", 128, "ImportError: no flashinfer")
    with pytest.raises(ConfigError, match=r"supported: \['auto', 'flashinfer', 'torch'\]"):
        EngineConfig(fused_kernels="triton")


def test_server_info_reports_the_fused_kernels_next_to_attention():
    info = cpu_server_info()
    assert info["fused_kernels"]["name"] == "torch"
    assert "CUDA device" in info["fused_kernels"]["reason"]
    assert info["attention_backend"]["name"] == "torch"


def test_compiled_rotary_of_the_whole_qkv_equals_the_reference_bit_for_bit():
    """Compiled (``tc_piecewise`` pieces), rotary is one expression over the fused qkv with v's
    heads passed through; eager, q and k are rotated apart. Same arithmetic per element: equal
    bits, v untouched, q/k/v column slices of one tensor (what the packed attention ops take).
    A formulation that rotated v, swapped the halves' signs or rotated the wrong heads fails."""
    from service.model.arch_config import RopeScaling
    from service.model.rotary import RotaryEmbedding

    ref = Kernels()
    torch.manual_seed(0)
    rotary = RotaryEmbedding(32, 256, 1e4, RopeScaling())
    positions = torch.randint(0, 256, (19,))
    qkv = torch.randn(19, (4 + 2 * 2) * 32).to(torch.bfloat16)
    sizes = (4 * 32, 2 * 32, 2 * 32)

    def rotate(qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return ref.rope_qkv(ref.rope_context(positions, rotary.cos_sin_cache), qkv, sizes, 32)

    want = rotate(qkv.clone())
    torch._dynamo.reset()
    got = torch.compile(rotate, fullgraph=True)(qkv.clone())
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert torch.equal(got[2], qkv[:, -64:]) and not torch.equal(got[0], qkv[:, :128])
    assert got[1].data_ptr() == got[0].data_ptr() + 128 * got[0].element_size()


# ---- CUDA: each fused kernel against the reference -------------------------------------------
FI_TOL = {"rms_norm": 2e-2, "add_rms_norm": 2e-2, "rope": 2e-2, "silu_and_mul": 2e-2}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 37, 2048])
def test_flashinfer_kernels_match_the_reference(tokens):
    """Each FlashInfer kernel against the torch reference on bf16, relative max error below 2%
    of the largest value (bf16 has 8 bits of mantissa; the references round differently)."""
    pytest.importorskip("flashinfer", reason="needs FlashInfer (the gpu extra)")
    from service.model.arch_config import RopeScaling
    from service.model.kernels import FlashInferKernels
    from service.model.rotary import RotaryEmbedding

    ref, fi = Kernels(), FlashInferKernels()
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(tokens)
    x = torch.randn(tokens, 1536, generator=g, device=dev).to(dt)
    res = torch.randn(tokens, 1536, generator=g, device=dev).to(dt)
    w = (1 + 0.1 * torch.randn(1536, generator=g, device=dev)).to(dt)
    assert rel_err(fi.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6)) < FI_TOL["rms_norm"]
    want_h, want_r = ref.add_rms_norm(x.clone(), res.clone(), w, 1e-6)
    got_h, got_r = fi.add_rms_norm(x.clone(), res.clone(), w, 1e-6)
    assert rel_err(got_r, want_r) < FI_TOL["add_rms_norm"]
    assert rel_err(got_h, want_h) < FI_TOL["add_rms_norm"]
    rotary = RotaryEmbedding(128, 4096, 1e6, RopeScaling()).to(dev)
    positions = torch.randint(0, 4096, (tokens,), generator=g, device=dev)
    qkv = torch.randn(tokens, (12 + 2 * 2) * 128, generator=g, device=dev).to(dt)
    q, k, _ = qkv.clone().split([12 * 128, 2 * 128, 2 * 128], dim=-1)  # strided column views
    wq, wk = ref.rope(ref.rope_context(positions, rotary.cos_sin_cache), q, k, 128)
    gq, gk = fi.rope(fi.rope_context(positions, rotary.cos_sin_cache), q, k, 128)
    assert gq.data_ptr() == q.data_ptr()  # in place, in the qkv tensor
    assert rel_err(gq, wq) < FI_TOL["rope"] and rel_err(gk, wk) < FI_TOL["rope"]
    gate_up = torch.randn(tokens, 2 * 8960, generator=g, device=dev).to(dt)
    assert rel_err(fi.silu_and_mul(gate_up), ref.silu_and_mul(gate_up)) < FI_TOL["silu_and_mul"]

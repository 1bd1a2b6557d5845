"""Every Triton kernel the service launches compiles, with the arguments its launcher really
passes, for the GPUs it runs on, here on a machine without one.

The CPU tests run torch stand-ins of these kernels, so a kernel that Triton refuses to compile
passes them all and fails only on a GPU: session 52's first GPU call found rope_store's bias
branch rejected ("the then block redefines it", a name turning from float32 into bf16), after a
whole session of CPU tests had passed. Here each launcher runs for real on CPU tensors of a real
model's shapes; its ``kernel[grid](...)`` is caught instead of launched, and that launch's exact
arguments (pointer dtypes, integer widths, constexprs, num_warps and num_stages) go through
Triton's whole compiler for the target: the frontend with its type checks, the GPU passes and
ptxas, to a cubin. Everything but running it, which the GPU tests do.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is in the test extra: install it")

# ruff: noqa: E402 (the kernels' modules import triton themselves)
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type

from service.model import (
    gate_up_tiles,
    gate_up_triton,
    rope_store_triton,
    splitk_policy,
    splitk_triton,
)
from service.ranks.attention import sm90_schedule, sm90_triton

# (major, minor) of the GPUs each kernel may run on: rope_store wherever FlashInfer's kernels
# run (sm80 and up); the split-K norm and the gate_up kernel from sm90 (TMA), auto on sm90 and
# by name on newer parts (GB200 is sm100); the SM90 schedule's planner and dealer on sm90 only
AMPERE, HOPPER, BLACKWELL = (8, 0), (9, 0), (10, 0)

# Qwen2.5-1.5B (the benchmarks' model; qkv with a bias) and Llama-3-8B: heads, kv heads, head
# dim, hidden, intermediate
QWEN = (12, 2, 128, 1536, 8960)
LLAMA = (32, 8, 128, 4096, 14336)


@dataclass
class Launch:
    kernel: Any  # triton.runtime.jit.JITFunction
    args: dict[str, Any]  # every parameter by name, as bound
    options: dict[str, int]  # num_warps, num_stages where given

    def spec(self) -> tuple[dict[str, str], dict[str, Any]]:
        """Triton's signature of this launch (each argument's type, as the runtime mangles it)
        and its constexprs' values: what the compiled kernel depends on."""
        constexprs = {p.name for p in self.kernel.params if p.is_constexpr}
        signature = {
            name: "constexpr" if name in constexprs else mangle_type(value)
            for name, value in self.args.items()
        }
        return signature, {name: self.args[name] for name in constexprs}

    def compile(self, cc: tuple[int, int]) -> Any:
        signature, constexprs = self.spec()
        src = ASTSource(fn=self.kernel, signature=signature, constexprs=constexprs)
        # FMA contraction on, as the GPU runtime's Triton compiles these kernels (its default
        # until 3.10; the rotary kernel's numerics note counts on it)
        options = {"enable_fp_fusion": True, **self.options}
        return triton.compile(src, target=GPUTarget("cuda", cc[0] * 10 + cc[1], 32),
                              options=options)  # fmt: skip


@dataclass
class Catch:
    """Stands in for a module's ``@triton.jit`` kernel: ``kernel[grid](...)`` records the
    launch instead of making it."""

    kernel: Any
    launches: list[Launch] = field(default_factory=list)

    def __getitem__(self, grid: object) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
            bound = inspect.signature(self.kernel.fn).bind(*args, **kwargs)
            bound.apply_defaults()
            self.launches.append(Launch(self.kernel, dict(bound.arguments), options))

        return launch


@pytest.fixture
def catch(monkeypatch: pytest.MonkeyPatch) -> Callable[[Any, str], Catch]:
    def patch(module: Any, name: str) -> Catch:
        caught = Catch(getattr(module, name))
        monkeypatch.setattr(module, name, caught)
        return caught

    return patch


def _compiles(launches: list[Launch], targets: tuple[tuple[int, int], ...]) -> Iterator[str]:
    """Compile each distinct launch for each target; yields what compiled, raises what not."""
    seen: set[str] = set()
    for launch in launches:
        for cc in targets:
            key = repr((launch.kernel.fn.__name__, *launch.spec(), launch.options, cc))
            if key in seen:
                continue
            seen.add(key)
            compiled = launch.compile(cc)
            assert compiled.asm.get("cubin"), f"no cubin for sm{cc[0]}{cc[1]}"
            yield f"{launch.kernel.fn.__name__} sm{cc[0]}{cc[1]}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("model", [QWEN, LLAMA], ids=["qwen2.5-1.5b", "llama-3-8b"])
def test_the_rotary_store_kernel_compiles_as_each_caller_launches_it(catch, dtype, model):
    """In place with and without qkv's bias (eager, `full`, `breakable`), and through both
    compiled-piece ops (a new tensor; the piece's hand-over buffer), with the model's int64
    positions and slots and the float32 (cos, sin) table."""
    hq, hkv, d, _, _ = model
    caught = catch(rope_store_triton, "_rope_store_kernel")
    t, width, slots = 256, (hq + 2 * hkv) * d, 1024
    qkv = torch.zeros(t, width, dtype=dtype)
    positions = torch.arange(t, dtype=torch.int64)
    table = torch.zeros(4096, d, dtype=torch.float32)
    kv = torch.zeros(slots + 1, 2, hkv, d, dtype=dtype)
    loc = torch.arange(t, dtype=torch.int64)
    bias = torch.zeros(width, dtype=dtype)
    for b in (None, bias):
        rope_store_triton.rope_store(qkv, (hq, hkv), d, positions, table, kv, loc, bias=b)
    rope_store_triton.rope_store_qkv_op(qkv, hq, hkv, d, positions, table, kv, loc)
    rope_store_triton.rope_store_qkv_into_op(
        qkv, hq, hkv, d, positions, table, kv, loc, torch.empty_like(qkv)
    )
    flags = {(la.args["COPY_V"], la.args["HAS_BIAS"]) for la in caught.launches}
    assert flags == {(False, False), (False, True), (True, False)}, flags
    done = list(_compiles(caught.launches, (AMPERE, HOPPER, BLACKWELL)))
    assert len(done) == 9, done


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_summing_norm_compiles_for_every_slice_count_the_policy_picks(catch, dtype):
    """o_proj (K = heads x head dim) and down (K = intermediate) of both models at the row
    counts the policy splits, plus the unsplit projection in the residual's dtype."""
    caught = catch(splitk_triton, "_sum_add_rms_norm_kernel")
    for hq, _, d, hidden, inter in (QWEN, LLAMA):
        wanted = {splitk_policy.slices(rows, k, hidden) for rows in (16, 256, 512)
                  for k in (hq * d, inter)}  # fmt: skip
        for s in sorted(wanted):
            parts = torch.zeros(s, 16, hidden, dtype=torch.float32 if s > 1 else dtype)
            residual = torch.zeros(16, hidden, dtype=dtype)
            weight = torch.zeros(hidden, dtype=dtype)
            splitk_triton.add_rms_norm(parts, residual, weight, 1e-6)
            splitk_triton.add_rms_norm(parts, residual, weight, 1e-6, torch.empty_like(residual))
    counts = {la.args["S"] for la in caught.launches}
    assert {1, 2, 4} <= counts, counts
    done = list(_compiles(caught.launches, (HOPPER, BLACKWELL)))
    assert len(done) >= 2 * len(counts), done  # each slice count, both targets


def test_the_gate_up_kernel_compiles_with_every_tile_it_is_given(catch):
    """Every tile gate_up_tiles hands out, captured or eager, on both models' MLPs (bf16: the
    kernel's only dtype), with its TMA descriptors as the launcher builds them."""
    caught = catch(gate_up_triton, "_gate_up_silu_kernel")
    tiles = {tile for tokens in range(1, 8193) for captured in (True, False)
             if (tile := gate_up_tiles.tile_for(tokens, captured)) is not None}  # fmt: skip
    assert len(tiles) >= 3, tiles
    for _, _, _, hidden, inter in (QWEN, LLAMA):
        assert gate_up_tiles.shape_blocker(hidden, inter, 2) is None
        for tile in sorted(tiles, key=repr):
            x = torch.zeros(tile.rows, hidden, dtype=torch.bfloat16)
            w = torch.zeros(2 * inter, hidden, dtype=torch.bfloat16)
            gate_up_triton.fused(x, w, tile)
    done = list(_compiles(caught.launches, (HOPPER, BLACKWELL)))
    assert len(done) == 2 * len(caught.launches), done


def test_the_sm90_planner_and_dealer_compile_as_the_schedule_launches_them(catch, monkeypatch):
    """The planner through the start-up probe's own path (planner_bytes) and the dealer through
    SM90Rebalance's device rewrite, with the H100's and H200's 132 CTAs."""
    planner = catch(sm90_triton, "_plan_kernel")
    dealer = catch(sm90_triton, "_deal_kernel")
    cpu = torch.device("cpu")
    sm90_schedule.planner_bytes(list(sm90_schedule.PROBE_LENGTHS), 12, 132, cpu)
    items, work_indptr = sm90_schedule.probe_items(132)
    plan = sm90_schedule.LaidOutPlan(items, work_indptr, cpu)
    rebalance = sm90_schedule.SM90Rebalance(cpu, 132, on_device=False)
    rebalance.on_device = True  # refused on a CPU device at construction; the launch is caught
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # no CUDA here
    rebalance(plan, 128)
    assert len(planner.launches) == 1 and len(dealer.launches) == 1
    done = list(_compiles(planner.launches + dealer.launches, (HOPPER,)))
    assert len(done) == 2, done

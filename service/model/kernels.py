"""The model's elementwise kernels: RMSNorm (with the residual add fused in), rotary, SiLU-and-mul;
and the row-parallel projections whose output goes straight into the add-RMSNorm (o_proj, down:
``row_linear``), which may hand the norm unsummed split-K partials (``SplitK``) to sum.

Two implementations with one interface, chosen once per rank at start-up
(service.ranks.select):

- :class:`TorchKernels`, the reference and the fallback (CPU, or CUDA without FlashInfer): plain
  torch, a chain of small kernels per call, out of place.
- :class:`FlashInferKernels` (the ``gpu`` extra): one kernel per call, in place where FlashInfer
  works in place (the fused residual add-norm updates both of its inputs; rotary rotates q and
  k where they lie, reading the cos/sin table at each token's position inside the kernel).

Callers use the returned tensors and never rely on an input being left untouched or on it being
updated: either may happen.

Shapes: T tokens, H hidden, D head dim; q (T, Hq*D), k (T, Hkv*D) may be column slices of one
fused qkv tensor (row stride larger than their width).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from service.model import splitk, splitk_op
from service.model.attention import KVTarget
from service.model.rope_store_policy import bias_in_rope
from service.model.rotary import cos_sin_at
from service.model.splitk_policy import slices as splitk_slices


class SplitK(NamedTuple):
    """A row-parallel projection's output not yet summed: float32 partial products over S
    slices of K, (S, T, N). Only :meth:`Kernels.add_rms_norm` consumes it (it sums them while
    adding the residual), so the reduction costs no kernel of its own."""

    parts: torch.Tensor


class Unprojected(NamedTuple):
    """A row-parallel projection not run yet, under ``torch.compile``: x (T, K) times
    weight (N, K)^T. Only :meth:`Kernels.add_rms_norm` consumes it: one opaque op runs the
    projection, split over K where service.model.splitk_policy says so at the call's rows,
    and the add-RMSNorm (service.model.splitk_op)."""

    x: torch.Tensor
    weight: torch.Tensor


# what a row-parallel projection feeding an add-RMSNorm gives it (Kernels.row_linear)
RowOutput = torch.Tensor | SplitK | Unprojected


class Kernels:
    """The reference: exactly the arithmetic of the original model code (plain torch)."""

    name = "torch"
    # service.model.gate_up_triton.gate_up_silu where the rank chose the fused gate_up kernel
    # (service.ranks.select.choose_gate_up), else None: the projection, then silu_and_mul
    _fused_gate_up: Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor] | None = None

    # service.model.rope_store_triton where the rank chose the rotary + K/V store kernel
    # (service.ranks.select.choose_rope_store), else None: the rotary kernel, then the store
    _rope_store: Any = None

    def use_rope_store(self) -> None:
        from service.model import rope_store_triton  # needs triton

        self._rope_store = rope_store_triton

    def stores_kv(self) -> bool:
        """Whether :meth:`rope_qkv_store` is the call to make: a rotary + K/V store kernel was
        chosen, and this is not a compiled trace (``tc_piecewise``'s pieces defer the store to
        their attention op)."""
        return self._rope_store is not None and not torch.compiler.is_compiling()

    def rope_adds_bias(self, rows: int) -> bool:
        """Whether :meth:`rope_qkv_store` over ``rows`` tokens should be given the projection's
        bias (the projection then runs without it). The reference: no, the GEMM adds it."""
        return False

    def rope_qkv_store(
        self,
        ctx: object,
        qkv: torch.Tensor,
        sizes: tuple[int, int, int],
        head_dim: int,
        target: KVTarget,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`rope_qkv`, then k and v to their slots of ``target``'s cache; ``bias``: the
        projection's, which it left out, added first. The reference: the three, one after the
        other."""
        if bias is not None:
            qkv.add_(bias)
        q, k, v = self.rope_qkv(ctx, qkv, sizes, head_dim)
        target.store(k, v)
        return q, k, v

    # service.model.splitk_triton.add_rms_norm where the rank chose the split-K projection +
    # add-RMSNorm (service.ranks.select.choose_splitk_norm), else None: the projection, then
    # the norm
    _splitk_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    def use_splitk_norm(self) -> None:
        from service.model import splitk_triton  # needs triton

        self._splitk_norm = splitk_triton.add_rms_norm

    def row_linear(self, x: torch.Tensor, proj: nn.Module) -> RowOutput:
        """``proj(x)`` for a row-parallel projection (service.model.parallel.RowParallelLinear)
        whose output goes straight into :meth:`add_rms_norm`: x (T, K) -> (T, N), or, where the
        split-K kernel was chosen and service.model.splitk_policy splits at T rows, its float32
        partials over K-slices. One rank only (tp 1): with more, the output is all-reduced in
        the input dtype first. Under ``torch.compile``, where the token count is symbolic, the
        projection is left to the norm's op (:class:`Unprojected`), which decides at run time."""
        if self._splitk_norm is not None and proj.tp.world_size == 1:
            weight = proj.weight
            if torch.compiler.is_compiling():
                return Unprojected(x, weight)
            s = splitk_slices(x.shape[0], x.shape[-1], weight.shape[0])
            if s > 1 and splitk.fits(x, weight, s):
                return SplitK(splitk.partials(x, weight, s))
        return proj(x)

    def use_fused_gate_up(self) -> None:
        from service.model.gate_up_triton import gate_up_silu  # needs triton

        self._fused_gate_up = gate_up_silu

    def gate_up_silu(self, x: torch.Tensor, gate_up_proj: nn.Module) -> torch.Tensor:
        """The MLP's first half: x (T, H) -> silu(x Wg^T) * (x Wu^T), (T, I), where
        ``gate_up_proj`` holds (2I, H) (gate rows, then up rows) and no bias."""
        if self._fused_gate_up is not None:
            return self._fused_gate_up(x, gate_up_proj.weight, self.name == "flashinfer")
        return self.silu_and_mul(gate_up_proj(x))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # x (T, H): normalise in float32, scale in the input dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def add_rms_norm(
        self, x: RowOutput, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x): the residual stream moves on by x. x may be
        :meth:`row_linear`'s partials: then one kernel sums them, adds and norms; or its
        projection still to run: then one op runs it, split or not, and the rest."""
        if isinstance(x, Unprojected):
            # a fresh tensor for the new residual, which the op fills (a tc_piecewise piece
            # passes its hand-over buffer there instead where the piece returns it)
            new = torch.empty_like(residual)
            normed = splitk_op.row_linear_add_rms_norm(x.x, x.weight, residual, weight, eps, new)
            return normed, new
        if isinstance(x, SplitK):
            if self._splitk_norm is not None and residual.stride(-1) == 1:
                return self._splitk_norm(x.parts, residual, weight, eps)
            return splitk.add_rms_norm(x.parts, residual, weight, eps)
        return self._add_rms_norm(x, residual, weight, eps)

    def _add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def rope_context(self, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> object:
        """What rotary needs for this forward's positions, looked up once for every layer:
        (cos, sin), each (T, 1, D/2) float32."""
        return cos_sin_at(cos_sin_cache, positions)

    def rope(
        self, ctx: object, q: torch.Tensor, k: torch.Tensor, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q (T, Hq*D) and k (T, Hkv*D) ("rotate half" layout)."""
        cos, sin = ctx  # type: ignore[misc]
        t = q.shape[0]
        q = _rotate(q.reshape(t, -1, head_dim), cos, sin).reshape(t, -1)
        k = _rotate(k.reshape(t, -1, head_dim), cos, sin).reshape(t, -1)
        return q, k

    def rope_qkv(
        self, ctx: object, qkv: torch.Tensor, sizes: tuple[int, int, int], head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv (T, Wq + Wk + Wv), the fused projection -> q and k rotated, v: column slices of
        widths ``sizes``, rotated by :meth:`rope`.

        Under ``torch.compile`` (``tc_piecewise`` pieces) the rotation is one elementwise
        function of the whole qkv instead (v's heads pass through), and q, k, v are slices of
        its result: inductor makes that one kernel, where q and k rotated apart and then joined
        to v were three on the H200 (docs/benchmarks.md, session 27, call E; session 28: 313
        kernels a forward instead of 369). The arithmetic per element is the same, so the
        results are bit-identical."""
        if torch.compiler.is_compiling():
            rotated = _rope_heads(ctx, qkv, (sizes[0] + sizes[1]) // head_dim, head_dim)
            return rotated.split(sizes, dim=-1)
        q, k, v = qkv.split(sizes, dim=-1)
        q, k = self.rope(ctx, q, k, head_dim)
        return q, k, v

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(T, 2I) -> silu(gate) * up, (T, I)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


TorchKernels = Kernels


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


def _rope_heads(ctx: object, x: torch.Tensor, rotated: int, head_dim: int) -> torch.Tensor:
    """x (T, heads * D) with its first ``rotated`` heads rotated, the rest as they are."""
    cos, sin = ctx  # type: ignore[misc]
    t = x.shape[0]
    heads = x.reshape(t, -1, head_dim)
    index = torch.arange(heads.shape[1], device=x.device).view(1, -1, 1)
    return torch.where(index < rotated, _rotate(heads, cos, sin), heads).reshape(t, -1)


class FlashInferKernels(Kernels):
    """FlashInfer's fused kernels (fp16/bf16 on CUDA).

    Under ``torch.compile`` (``tc_piecewise`` pieces) the reference chains are traced instead:
    inductor fuses them into its own kernels, together with their neighbours, which an opaque
    FlashInfer call would prevent.
    """

    name = "flashinfer"

    def __init__(self) -> None:
        import flashinfer  # the `gpu` extra; service.ranks.select decided it is importable

        self.fi = flashinfer

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return super().rms_norm(x, weight, eps)
        return self.fi.norm.rmsnorm(x, weight, eps)

    def _add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling():
            return super()._add_rms_norm(x, residual, weight, eps)
        # in place: residual += x, then x = rms_norm(residual) * weight; one kernel
        self.fi.norm.fused_add_rmsnorm(x, residual, weight, eps)
        return x, residual

    def stores_kv(self) -> bool:
        # compiled pieces too: there the kernel is one opaque op (rope_store_qkv_op)
        return self._rope_store is not None

    def rope_adds_bias(self, rows: int) -> bool:
        # the kernel's eager call (eager, full, breakable); compiled pieces keep the GEMM's
        # bias (their op takes none)
        return (
            self._rope_store is not None
            and not torch.compiler.is_compiling()
            and bias_in_rope(rows)
        )

    def rope_context(self, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> object:
        if torch.compiler.is_compiling() and self._rope_store is None:
            return super().rope_context(positions, cos_sin_cache)
        return positions, cos_sin_cache  # the kernel reads the table at each position itself

    def _traced_ctx(self, ctx: object) -> object:
        """The (cos, sin) the traced reference needs: with the rotary + store kernel chosen, a
        compiled forward's context is (positions, table), as the kernel's op reads it."""
        if self._rope_store is None:
            return ctx
        positions, table = ctx  # type: ignore[misc]
        return Kernels.rope_context(self, positions, table)

    def rope_qkv(
        self, ctx: object, qkv: torch.Tensor, sizes: tuple[int, int, int], head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling():
            return super().rope_qkv(self._traced_ctx(ctx), qkv, sizes, head_dim)
        return super().rope_qkv(ctx, qkv, sizes, head_dim)

    def rope(
        self, ctx: object, q: torch.Tensor, k: torch.Tensor, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling():
            return super().rope(self._traced_ctx(ctx), q, k, head_dim)
        positions, cache = ctx  # type: ignore[misc]
        self.fi.rope.apply_rope_with_cos_sin_cache_inplace(
            positions, q, k, head_dim, cache, is_neox=True
        )
        return q, k

    def rope_qkv_store(
        self,
        ctx: object,
        qkv: torch.Tensor,
        sizes: tuple[int, int, int],
        head_dim: int,
        target: KVTarget,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # one kernel: the bias added where given, q and k rotated (in place in qkv, or into the
        # op's new tensor when compiled), K and V written to their slots
        m = self._rope_store
        if m is None:
            return super().rope_qkv_store(ctx, qkv, sizes, head_dim, target, bias)
        positions, table = ctx  # type: ignore[misc]
        heads = (sizes[0] // head_dim, sizes[1] // head_dim)
        if sizes[1] == sizes[2] and m.fits(qkv, heads, head_dim, target.cache):
            loc = target.loc[: qkv.shape[0]]
            if torch.compiler.is_compiling():  # never given the bias (rope_adds_bias)
                if bias is not None:
                    qkv = qkv + bias
                qkv = m.rope_store_qkv_op(qkv, *heads, head_dim, positions, table, target.cache,
                                          loc)  # fmt: skip
            else:
                m.rope_store(qkv, heads, head_dim, positions, table, target.cache, loc, bias=bias)
            q, k, v = qkv.split(sizes, dim=-1)
            return q, k, v
        # the reference (under compile, rope_qkv looks the (cos, sin) up from the context)
        return super().rope_qkv_store(ctx, qkv, sizes, head_dim, target, bias)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return super().silu_and_mul(gate_up)
        return self.fi.activation.silu_and_mul(gate_up)

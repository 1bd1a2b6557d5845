"""Tensor-parallel layers (Megatron style): column/row-parallel linear, vocab-parallel embedding.

Each parameter carries a ``weight_loader(param, full_tensor, shard_id)`` that slices this rank's
part out of the full checkpoint tensor, so loading any shard is one loop over checkpoint names.
At tp=1 every layer is a plain linear; at tp>1 the row-parallel output and the LM head's logits
go through the group's collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.nn import functional as F

from service.errors import CheckpointError


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in the tensor-parallel group (group None at tp=1)."""

    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks. Use the result: on CPU it is a new tensor."""
        if self.world_size == 1:
            return x
        if x.is_cuda:  # in place, NCCL: what a CUDA graph captures
            dist.all_reduce(x, group=self.group)
            return x
        # gloo: the functional collective, whose wait is an op of its own, so a traced graph
        # (a CPU capture) keeps it; dist.all_reduce's wait is host code a trace would lose
        return funcol.all_reduce(x, "sum", self.group)

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """(N, W) on each rank -> (N, world * W), rank r's part at columns [r W, (r+1) W)."""
        if self.world_size == 1:
            return x
        if x.is_cuda:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.all_gather(parts, x.contiguous(), group=self.group)
            return torch.cat(parts, dim=-1)
        # gloo: functional, so a recorded CPU graph keeps the wait (see all_reduce)
        return funcol.all_gather_single(x.contiguous(), x.dim() - 1, self.group)

    def split(self, size: int, what: str) -> int:
        if size % self.world_size:
            raise CheckpointError(
                f"{what} = {size} is not divisible by tp = {self.world_size}; choose a tp that "
                "divides it"
            )
        return size // self.world_size


WeightLoader = Callable[[nn.Parameter, torch.Tensor, "str | int | None"], None]


def shape_of(loaded: object) -> tuple[int, ...]:
    """Shape of a tensor or of a lazy safetensors slice (read without loading it)."""
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())  # type: ignore[attr-defined]


def take(loaded: object, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows/columns [start, start+length) of dim 0 or 1; a lazy slice reads only that part."""
    index = (
        (slice(start, start + length),) if dim == 0 else (slice(None), slice(start, start + length))
    )
    return loaded[index]  # type: ignore[index]


def read_all(loaded: object) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]  # type: ignore[index]


def copy_checked(param: nn.Parameter, loaded: object, shard_id: str | int | None = None) -> None:
    """The default loader: the whole tensor, same shape."""
    if tuple(param.shape) != shape_of(loaded):
        raise CheckpointError(f"expected shape {tuple(param.shape)}, found {shape_of(loaded)}")
    with torch.no_grad():
        param.copy_(read_all(loaded).to(param.dtype))


def _attach(param: nn.Parameter, loader: Callable[..., None]) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W split along the output dim; ``output_sizes`` are the fused parts.

    For a fused projection (qkv, gate_up) each part is split separately, so shard ``i`` of the
    checkpoint lands in this rank's slice of part ``i``.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        tp: TPGroup,
        bias: bool,
        shard_ids: Sequence[str | int] | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.full_sizes = list(output_sizes)
        self.local_sizes = [tp.split(s, "output size") for s in output_sizes]
        self.shard_ids = (
            list(shard_ids) if shard_ids is not None else list(range(len(output_sizes)))
        )
        out_local = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(out_local, in_features), requires_grad=False)
        _attach(self.weight, self._load)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False)
            _attach(self.bias, self._load)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None) -> None:
        part = 0 if shard_id is None else self.shard_ids.index(shard_id)
        full, local = self.full_sizes[part], self.local_sizes[part]
        target = param.data.narrow(0, sum(self.local_sizes[:part]), local)
        expected = (full, *target.shape[1:])
        if shape_of(loaded) != expected:
            raise CheckpointError(
                f"shard {shard_id!r}: expected shape {expected}, found {shape_of(loaded)}"
            )
        target.copy_(take(loaded, 0, self.tp.rank * local, local).to(param.dtype))

    def forward(
        self, x: torch.Tensor, out: torch.Tensor | None = None, add_bias: bool = True
    ) -> torch.Tensor:
        """(T, in) -> (T, out_local), written into ``out`` when given (the same GEMM that
        ``F.linear`` runs for 2-D input: addmm with a bias, mm without). ``add_bias=False``:
        without the bias, which the caller's next kernel adds (the rotary kernel, for qkv)."""
        bias = self.bias if add_bias else None
        if out is None:
            return F.linear(x, self.weight, bias)
        if bias is None:
            return torch.mm(x, self.weight.t(), out=out)
        return torch.addmm(bias, x, self.weight.t(), out=out)


class RowParallelLinear(nn.Module):
    """y = x W^T with W split along the input dim; partial sums are all-reduced across ranks."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.in_local = tp.split(in_features, "input size")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local), requires_grad=False)
        _attach(self.weight, self._load)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None) -> None:
        expected = (param.shape[0], self.in_local * self.tp.world_size)
        if shape_of(loaded) != expected:
            raise CheckpointError(f"expected shape {expected}, found {shape_of(loaded)}")
        with torch.no_grad():
            param.copy_(
                take(loaded, 1, self.tp.rank * self.in_local, self.in_local).to(param.dtype)
            )

    def partial(self, x: torch.Tensor) -> torch.Tensor:  # (T, in_local) -> (T, out)
        """This rank's partial sum, for a caller that adds other partials before reducing."""
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(T, in_local) -> (T, out), summed over ranks; written into ``out`` (contiguous rows
        of a larger output) when given, and ``out`` returned."""
        if out is None:
            return self.tp.all_reduce(self.partial(x))
        torch.mm(x, self.weight.t(), out=out)
        summed = self.tp.all_reduce(out)
        if summed is not out:  # gloo's functional collective returns a new tensor
            out.copy_(summed)
        return out


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across ranks; out-of-shard ids contribute zeros, then all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.padded_vocab = -(-vocab_size // tp.world_size) * tp.world_size
        self.local_vocab = self.padded_vocab // tp.world_size
        self.start = tp.rank * self.local_vocab
        self.weight = nn.Parameter(torch.zeros(self.local_vocab, hidden_size), requires_grad=False)
        _attach(self.weight, self._load)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None) -> None:
        expected = (self.vocab_size, param.shape[1])
        if shape_of(loaded) != expected:
            raise CheckpointError(f"expected shape {expected}, found {shape_of(loaded)}")
        rows = max(0, min(self.local_vocab, self.vocab_size - self.start))
        with torch.no_grad():
            param.data.zero_()
            param.data[:rows].copy_(take(loaded, 0, self.start, rows).to(param.dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, H)
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.local_vocab)
        out = F.embedding(local.clamp(0, self.local_vocab - 1), self.weight)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over this rank's vocab shard, gathered to the full vocab."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (N, H) -> (N, V)
        local = F.linear(hidden, self.weight)
        full = self.tp.all_gather_last_dim(local)
        return full[:, : self.vocab_size]

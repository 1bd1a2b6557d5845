"""How a piece's outputs reach the buffers the runner hands to the next call (pure FX work).

A piece writes each shared output into its hand-over buffer (``run_into``). Where inductor
generates the kernel that computes the output, the write is that kernel's store. Where an
opaque custom op computes it (the rotary + K/V store kernel's op, whose output is the q/K/V
block attention reads), the write would be one more copy kernel of the whole block per layer.
So a copy of the piece's graph calls the op's twin (service.model.out_twins) on the buffer
itself, given to the piece as an extra input, and the op's output is that buffer. An output
that is a fresh ``torch.empty_like`` tensor which an op overwrites whole (the split-K
projection + add-RMSNorm op's new residual, service.model.splitk_op) becomes the buffer itself:
the op then writes the buffer.

Before that, a concatenation of a split's slices, all in order along the split's dimension,
becomes the split tensor itself. ``OpAttention`` joins q, K and V that way (the slices of one
rotated projection), and inductor makes the same replacement after tracing; it is done here
first so that the op is what the piece returns.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx

from service.model.out_twins import filled_argument, twin_of

_SPLITS = ("split", "split_with_sizes")


@dataclass(frozen=True)
class Redirected:
    """A piece's graph whose ``outputs`` (positions in its output tuple) are written by twins
    into buffers it takes as extra trailing inputs, in that order."""

    module: fx.GraphModule
    outputs: tuple[int, ...]


def _split_of(node: object) -> tuple[fx.Node, tuple[int, ...], object] | None:
    """(input, sizes, dim) of a ``tensor.split(sizes, dim)`` node with a list of sizes."""
    if not isinstance(node, fx.Node) or node.op != "call_method" or node.target not in _SPLITS:
        return None
    src, sizes = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("split_size")
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    if not isinstance(src, fx.Node) or not isinstance(sizes, (list, tuple)):
        return None
    return src, tuple(sizes), dim


def collapse_split_cat(graph: fx.Graph) -> int:
    """Replace ``cat(x.split(sizes, d)[0..n-1], d)`` by ``x`` where ``x`` is an op with a twin
    and nothing else reads x, the split or its slices (so the cat's users may treat x as their
    own fresh tensor, as they did the cat). Returns how many were replaced."""
    replaced = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.cat:
            continue
        parts = node.args[0] if node.args else node.kwargs.get("tensors")
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        if not isinstance(parts, (list, tuple)) or not parts:
            continue
        first = parts[0]
        if not (isinstance(first, fx.Node) and first.target is operator.getitem):
            continue
        split_node = first.args[0]
        split = _split_of(split_node)
        if split is None:
            continue
        src, sizes, split_dim = split
        ordered = all(
            isinstance(p, fx.Node) and p.target is operator.getitem
            and p.args == (split_node, i) and list(p.users) == [node]
            for i, p in enumerate(parts)
        )  # fmt: skip
        if (
            ordered and len(parts) == len(sizes) and dim == split_dim
            and src.op == "call_function" and twin_of(src.target) is not None
            and len(src.users) == 1 and len(split_node.users) == len(parts)
        ):  # fmt: skip
            node.replace_all_uses_with(src)
            graph.erase_node(node)
            for p in parts:
                graph.erase_node(p)
            graph.erase_node(split_node)
            replaced += 1
    return replaced


def _filled(node: fx.Node) -> bool:
    """Whether ``node`` is a fresh ``torch.empty_like`` tensor that an op overwrites whole."""
    if node.op != "call_function" or node.target is not torch.empty_like:
        return False
    for user in node.users:
        filled = filled_argument(user.target) if user.op == "call_function" else None
        if filled is None:
            continue
        position, name = filled
        given = user.args[position] if len(user.args) > position else user.kwargs.get(name)
        if given is node:
            return True
    return False


def redirect_outputs(sub: fx.GraphModule) -> Redirected | None:
    """A copy of ``sub`` whose outputs made by ops with twins are written by the twins into
    buffers taken as extra inputs, and whose outputs allocated empty and filled by an op are
    those buffers; or None where no output is made so. ``sub`` is left as is."""
    graph = copy.deepcopy(sub.graph)
    collapse_split_cat(graph)
    output = graph.output_node()
    result = output.args[0]
    flat = list(result) if isinstance(result, (list, tuple)) else [result]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    redirected: list[int] = []
    for i, node in enumerate(flat):
        # an op returned at two positions is written at the first; the second is its copy
        if not isinstance(node, fx.Node) or node.op != "call_function" or node in flat[:i]:
            continue
        twin = twin_of(node.target)
        if twin is None and not _filled(node):
            continue
        # placeholders lead the graph: after the last one (pieces always have inputs)
        with graph.inserting_after(placeholders[-1]):
            buffer = graph.placeholder(f"handover_{i}")
        placeholders.append(buffer)
        if twin is not None:
            with graph.inserting_before(node):
                graph.call_function(twin, (*node.args, buffer), dict(node.kwargs))
        node.replace_all_uses_with(buffer)
        graph.erase_node(node)
        redirected.append(i)
    if not redirected:
        return None
    graph.lint()
    return Redirected(fx.GraphModule(sub, graph), tuple(redirected))


def run_into(sub: fx.GraphModule) -> Callable:
    """``sub``, writing its buffered outputs into the given ``outs`` (None: returned as is).
    Outputs that a twin can write go straight into their buffers; the rest are copied there
    (inside compiled code: fused into the kernel that computes them)."""
    into = redirect_outputs(sub)

    def run(outs: list[torch.Tensor | None], *args: object) -> object:
        written: tuple[int, ...] = ()
        if into is not None and all(outs[i] is not None for i in into.outputs):
            res = into.module(*args, *(outs[i] for i in into.outputs))
            written = into.outputs
        else:
            res = sub(*args)
        flat = res if isinstance(res, (tuple, list)) else (res,)
        for i, (o, r) in enumerate(zip(outs, flat, strict=False)):
            if o is not None and i not in written:
                o.copy_(r)
        return tuple(o if o is not None else r for o, r in zip(outs, flat, strict=False))

    return run

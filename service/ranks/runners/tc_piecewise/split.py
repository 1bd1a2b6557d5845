"""Splitting a dynamo-traced forward at attention, and what the pieces may share.

Pure FX-graph work: which nodes are attention (the opaque custom op), which outputs of a piece
die once the next piece has run (so their buffers can be reused), which pieces compute the same
function (so they can share one compiled callable), and a rewrite that lets the split graph call
attention directly instead of through the dispatcher at every replay.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from service.errors import CaptureFailed
from service.ranks.attention.custom_op import direct_attention, direct_attention_qkv

# each attention custom op (the target dynamo records, default overload or packet) and the
# plain function a split graph calls instead
_DIRECT = {
    torch.ops.capture_service.attention.default: direct_attention,
    torch.ops.capture_service.attention: direct_attention,
    torch.ops.capture_service.attention_qkv.default: direct_attention_qkv,
    torch.ops.capture_service.attention_qkv: direct_attention_qkv,
}
_ATTENTION_TARGETS = (*_DIRECT, direct_attention, direct_attention_qkv)


def is_attention(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _ATTENTION_TARGETS


def is_attention_piece(sub: fx.GraphModule) -> bool:
    return any(is_attention(n) for n in sub.graph.nodes)


def split_at_attention(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` split into submodules: one per attention call, and the pieces between them."""
    counter = {"part": 0}

    def partition(node: fx.Node) -> int:
        if is_attention(node):
            counter["part"] += 1
            part = counter["part"]
            counter["part"] += 1
            return part
        return counter["part"]

    return split_module(gm, None, partition, keep_original_order=True)


def call_attention_directly(sub: fx.GraphModule) -> None:
    """Replace the custom-op call in an attention piece by a plain Python call of the same
    function. The op exists so that dynamo keeps attention opaque while tracing; at replay, its
    dispatcher round trip (schema checks, the fake-tensor registration, the alias check) is pure
    host overhead between two graph replays."""
    for node in sub.graph.nodes:
        if node.op == "call_function" and node.target in _DIRECT:
            node.target = _DIRECT[node.target]
    sub.recompile()


def check_tape_structure(split: fx.GraphModule) -> None:
    """Raise unless the split graph's own code does nothing a replay tape would skip: its
    top level only calls pieces and attention submodules and unpacks their outputs, and each
    attention submodule is the attention call alone. (A tape replays the pieces' graphs and the
    attention calls; anything else computed between them would be lost.)"""
    for node in split.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target is operator.getitem:
            continue
        if node.op == "call_module":
            sub = split.get_submodule(node.target)
            inner = [n for n in sub.graph.nodes if n.op not in ("placeholder", "output")]
            if not is_attention_piece(sub) or (len(inner) == 1 and is_attention(inner[0])):
                continue
        raise CaptureFailed(
            f"tc_piecewise: the traced forward computes {node.format_node()} between its "
            "pieces; replays run the pieces' graphs and attention only (use --prefill-backend "
            "breakable for this model)"
        )


def call_modules_directly(split: fx.GraphModule) -> None:
    """Make the split graph call each submodule's ``forward`` as a plain function. A module
    call goes through ``nn.Module.__call__`` (hook and tracing-state checks; for a GraphModule
    its ``call_wrapped`` too) after an attribute lookup through ``nn.Module.__getattr__``: a few
    microseconds each, twice per layer (piece, attention) between graph replays. The submodules
    stay registered; none of them has hooks."""
    for node in split.graph.nodes:
        if node.op == "call_module":
            node.target = _plain_call(split.get_submodule(node.target))
            node.op = "call_function"
    split.recompile()


def _plain_call(module: torch.nn.Module) -> Callable:
    real_recompile = getattr(module, "real_recompile", None)
    if real_recompile is not None:  # a lazy GraphModule: its code generated now, not at call
        real_recompile()
    forward = module.forward

    def call(*args: object) -> object:  # a plain function: FX names it as a global of its own
        return forward(*args)

    return call


def shareable_outputs(split: fx.GraphModule) -> dict[str, list[bool]]:
    """Per piece: which outputs are dead once the next piece has run (so buffers can be reused).

    An output is shareable when every user comes before (or is) the next non-attention piece.
    """
    nodes = list(split.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    pieces = [
        n for n in nodes
        if n.op == "call_module" and not is_attention_piece(getattr(split, n.target))
    ]  # fmt: skip
    result: dict[str, list[bool]] = {}
    for j, node in enumerate(pieces):
        limit = pos[pieces[j + 1]] if j + 1 < len(pieces) else -1
        getitems = [
            u for u in node.users if u.op == "call_function" and u.target is operator.getitem
        ]
        if getitems and len(getitems) == len(node.users):
            width = max(g.args[1] for g in getitems) + 1
            flags = [False] * width
            for g in getitems:
                flags[g.args[1]] = limit >= 0 and all(pos[u] <= limit for u in g.users)
        else:
            flags = [limit >= 0 and all(pos[u] <= limit for u in node.users)]
        result[node.target] = flags
    return result


def piece_signature(sub: fx.GraphModule) -> tuple:
    """The piece's graph up to placeholder names. Parameters are graph inputs (dynamo lifts
    them), so pieces of equal signature (the middle layers) compute the same function of their
    arguments and can share one compiled callable."""
    index: dict[fx.Node, int] = {}
    sig = []
    for i, node in enumerate(sub.graph.nodes):
        index[node] = i
        if node.op in ("get_attr", "call_module"):  # state of its own: never shared
            return ("unshared", id(sub))
        args = fx.node.map_arg((node.args, node.kwargs), lambda a: ("node", index[a]))
        target = "" if node.op == "placeholder" else str(node.target)
        sig.append((node.op, target, repr(args)))
    return tuple(sig)

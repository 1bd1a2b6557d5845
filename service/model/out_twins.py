"""Custom ops that return a new tensor, each paired with a twin that writes the same values into
a buffer it is given.

Why: a ``tc_piecewise`` piece hands its outputs to the next attention call through buffers the
runner shares between pieces (service.ranks.runners.tc_piecewise). Where inductor generates the
kernel that computes an output, it stores straight into that buffer; where an opaque custom op
computes it, inductor can only copy the op's fresh tensor there afterwards: for the rotary +
K/V store op, the whole (T, (Hq + 2 Hkv) D) q/K/V block once more per layer (4.45 us a layer at
2,048 tokens on an H100, docs/benchmarks.md, session 37). A twin, declared as mutating only its
last argument ``out``, lets the piece pass the hand-over buffer in; inductor then calls it on
the buffer in place, with no copy.

The contract: ``twin(*op_args, out)`` writes exactly ``op(*op_args)`` into ``out`` (same shape,
dtype and bits, the same side effects) and returns None. The module that defines an op
registers its twin here; the piece code looks the twin up by the FX node's target. No torch
import: targets are whatever objects the traced graph names (OpOverload, OpOverloadPacket).

An op that already writes an output into a tensor its caller made (a declared mutation of an
argument the op overwrites whole, every element, whatever it held) needs no twin: the piece
passes the hand-over buffer as that argument instead of the fresh tensor. Such ops register
the argument's position and name with :func:`register_filled`.
"""

from __future__ import annotations

from typing import Any

_TWINS: dict[Any, Any] = {}
_FILLED: dict[Any, tuple[int, str]] = {}


def register(packet: Any, twin: Any) -> None:
    """``twin`` (an op overload) writes into its ``out`` what the ops of ``packet`` (an
    OpOverloadPacket: ``torch.ops.ns.name``) return; graphs name the packet or its default."""
    _TWINS[packet] = twin
    _TWINS[packet.default] = twin


def twin_of(target: Any) -> Any | None:
    """The twin of an FX node's target, or None where it has none."""
    try:
        return _TWINS.get(target)
    except TypeError:  # an unhashable target (a bound method of an unhashable object)
        return None


def register_filled(packet: Any, position: int, name: str) -> None:
    """The ops of ``packet`` overwrite their argument ``name``, at ``position``, whole (declared
    mutated), reading nothing it held before."""
    _FILLED[packet] = (position, name)
    _FILLED[packet.default] = (position, name)


def filled_argument(target: Any) -> tuple[int, str] | None:
    """The position and name of the argument an FX node's target overwrites whole, or None."""
    try:
        return _FILLED.get(target)
    except TypeError:
        return None

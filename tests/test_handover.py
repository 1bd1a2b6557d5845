"""tc_piecewise's hand-over: a piece output computed by an opaque op with a twin is written by
the twin straight into the buffer the next call reads, with no copy (on CPU, under the real
torch.compile and inductor); what may not be rewritten is left as it was."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx

from service.model import (
    out_twins,
    splitk_op,  # noqa: F401  (registers capture_service::row_linear_add_rms_norm)
)
from service.ranks.runners.tc_piecewise.handover import (
    collapse_split_cat,
    redirect_outputs,
    run_into,
)

_twin_outs: list[int] = []


@torch.library.custom_op("capture_service_test::scale3", mutates_args=())
def _scale3(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor + 1


@_scale3.register_fake
def _(x, factor):
    return torch.empty_like(x)


@torch.library.custom_op("capture_service_test::scale3_into", mutates_args=("out",))
def _scale3_into(x: torch.Tensor, factor: float, out: torch.Tensor) -> None:
    _twin_outs.append(out.data_ptr())
    torch.mul(x, factor, out=out).add_(1)


@_scale3_into.register_fake
def _(x, factor, out):
    return None


out_twins.register(torch.ops.capture_service_test.scale3,
                   torch.ops.capture_service_test.scale3_into.default)  # fmt: skip


def _piece(order=(0, 1, 2), extra_reader=False, op=None) -> fx.GraphModule:
    """What a traced piece looks like at its end: a projection, the op, q/K/V split and joined
    again for attention (in ``order``), the stored token, and the residual stream."""
    op = op or torch.ops.capture_service_test.scale3.default
    g = fx.Graph()
    x, w, residual = g.placeholder("x"), g.placeholder("w"), g.placeholder("residual")
    proj = g.call_function(torch.nn.functional.linear, (x, w))
    made = g.call_function(op, (proj, 2.0))
    split = g.call_method("split", (made, (4, 2, 2)), {"dim": -1})
    parts = [g.call_function(operator.getitem, (split, i)) for i in range(3)]
    cat = g.call_function(torch.cat, ([parts[i] for i in order],), {"dim": -1})
    token = g.call_method("new_empty", (cat, 0))
    outs = [cat, token, g.call_function(operator.add, (residual, x))]
    if extra_reader:  # a slice read by something other than the join
        outs.append(g.call_method("sum", (parts[0],)))
    g.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), g)


def _inputs(rows: int = 5):
    torch.manual_seed(0)
    return torch.randn(rows, 8), torch.randn(8, 8), torch.randn(rows, 8)


def _targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def test_the_op_writes_into_the_buffer_and_the_join_of_its_slices_is_gone():
    sub = _piece()
    before = _targets(sub)
    red = redirect_outputs(sub)
    assert red is not None and red.outputs == (0,)
    targets = _targets(red.module)
    assert torch.ops.capture_service_test.scale3_into.default in targets
    assert torch.ops.capture_service_test.scale3.default not in targets
    assert torch.cat not in targets and "split" not in targets
    assert _targets(sub) == before  # the piece itself is left as it was (it learns its outputs)
    x, w, r = _inputs()
    buf = torch.full((16, 8), float("nan"))[:5]
    _twin_outs.clear()
    got = red.module(x, w, r, buf)
    want = sub(x, w, r)
    assert got[0] is buf and _twin_outs == [buf.data_ptr()]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_what_cannot_be_rewritten_is_left_alone():
    # slices joined out of order: the join is a real permutation, not the op's output
    assert redirect_outputs(_piece(order=(1, 0, 2))) is None
    # a slice read elsewhere: the join stays (no op output at the piece's end either)
    assert redirect_outputs(_piece(extra_reader=True)) is None
    # an op without a twin
    plain = torch.ops.aten.mul.Scalar
    sub = _piece(op=plain)
    graph = sub.graph
    assert collapse_split_cat(graph) == 0 and torch.cat in _targets(sub)


def test_an_op_returned_twice_is_written_once_and_copied_once():
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    proj = g.call_function(torch.nn.functional.linear, (x, w))
    made = g.call_function(torch.ops.capture_service_test.scale3.default, (proj, 2.0))
    g.output((made, made))
    sub = fx.GraphModule(torch.nn.Module(), g)
    red = redirect_outputs(sub)
    assert red is not None and red.outputs == (0,)
    x_, w_, _ = _inputs()
    a, b = torch.zeros(5, 8), torch.zeros(5, 8)
    _twin_outs.clear()
    got = run_into(sub)([a, b], x_, w_)
    want = sub(x_, w_)[0]
    assert got == (a, b) and _twin_outs == [a.data_ptr()]
    assert torch.equal(a, want) and torch.equal(b, want)


def test_run_into_falls_back_to_a_copy_where_no_buffer_is_given():
    sub = _piece()
    run = run_into(sub)
    x, w, r = _inputs()
    want = sub(x, w, r)
    buf = torch.zeros(5, 8)
    _twin_outs.clear()
    got = run([buf, None, None], x, w, r)
    assert got[0] is buf and _twin_outs == [buf.data_ptr()] and torch.equal(buf, want[0])
    _twin_outs.clear()
    got = run([None, None, torch.zeros(5, 8)], x, w, r)  # no buffer for the op's output
    assert _twin_outs == [] and torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])


def test_inductor_calls_the_twin_on_the_buffer_and_copies_nothing():
    """Compiled as tc_piecewise compiles a piece (dynamic rows, fullgraph): the generated code
    calls the twin on the buffer it was given and has no kernel of its own for that output (a
    piece that copied the op's fresh tensor into the buffer has one: ``cpp_fused_copy_``)."""
    from torch._inductor.utils import run_and_get_code

    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    proj = g.call_function(torch.nn.functional.linear, (x, w))
    made = g.call_function(torch.ops.capture_service_test.scale3.default, (proj, 2.0))
    split = g.call_method("split", (made, (4, 2, 2)), {"dim": -1})
    parts = [g.call_function(operator.getitem, (split, i)) for i in range(3)]
    g.output((g.call_function(torch.cat, (parts,), {"dim": -1}),))
    sub = fx.GraphModule(torch.nn.Module(), g)
    torch._dynamo.reset()
    fn = torch.compile(run_into(sub), dynamic=True, fullgraph=True)
    x_, w_, _ = _inputs(7)
    big = torch.full((32, 8), float("nan"))
    _twin_outs.clear()
    (got,), code = run_and_get_code(fn, [big[:7]], x_, w_)
    src = "\n".join(code)
    assert "scale3_into.default(" in src and "copy" not in src.lower()
    assert got.data_ptr() == big.data_ptr() and _twin_outs == [big.data_ptr()]
    assert torch.equal(big[:7], sub(x_, w_)[0]) and big[7:].isnan().all()


def _norm_piece(filler=None, by_keyword: bool = False) -> fx.GraphModule:
    """A piece's end with the split-K projection + add-RMSNorm op (service.model.splitk_op):
    the new residual is a fresh ``empty_like`` tensor the op fills, returned beside the norm."""
    g = fx.Graph()
    x, w, residual, gamma = (g.placeholder(n) for n in ("x", "w", "residual", "gamma"))
    new = g.call_function(torch.empty_like, (residual,))
    if filler is None:
        op = torch.ops.capture_service.row_linear_add_rms_norm.default
        if by_keyword:
            normed = g.call_function(op, (x, w, residual, gamma, 1e-6), {"new_residual": new})
        else:
            normed = g.call_function(op, (x, w, residual, gamma, 1e-6, new))
    else:  # something else writing into the fresh tensor
        normed = g.call_function(filler, (residual, gamma), {"out": new})
    g.output((normed, new))
    return fx.GraphModule(torch.nn.Module(), g)


def _norm_inputs(rows: int):
    g = torch.Generator().manual_seed(rows)
    # K 512 (2 slices from 16 rows), N 256: at 64 rows the op splits, at 600 it does not
    x, w = torch.randn(rows, 512, generator=g), torch.randn(256, 512, generator=g) / 512**0.5
    return x, w, torch.randn(rows, 256, generator=g), torch.rand(256, generator=g) + 0.5


@pytest.mark.parametrize("by_keyword", [False, True])
def test_the_new_residual_the_norm_op_fills_is_the_hand_over_buffer_itself(by_keyword):
    """The op is given the buffer as the tensor it fills (passed by position or by name): no
    ``empty_like`` left, the buffer holds the new residual, the norm is the op's own; and the
    piece's input residual (the previous piece's hand-over buffer) is left as it was."""
    sub = _norm_piece(by_keyword=by_keyword)
    red = redirect_outputs(sub)
    assert red is not None and red.outputs == (1,)
    assert torch.empty_like not in _targets(red.module)
    for rows in (64, 600):
        x, w, r, gamma = _norm_inputs(rows)
        r0 = r.clone()
        want = sub(x, w, r, gamma)
        buf = torch.full((1024, 256), float("nan"))[:rows]
        got = red.module(x, w, r, gamma, buf)
        assert got[1] is buf and torch.equal(buf, want[1]) and torch.equal(got[0], want[0])
        assert torch.equal(r, r0)
        # and the values are the projection, the add and the norm
        s = r0 + torch.nn.functional.linear(x, w)
        torch.testing.assert_close(buf, s, rtol=1e-5, atol=1e-5)
        norm = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma
        torch.testing.assert_close(got[0], norm, rtol=1e-5, atol=1e-5)


def test_an_empty_output_something_else_fills_keeps_its_copy():
    assert redirect_outputs(_norm_piece(filler=torch.mul)) is None


def test_inductor_runs_the_norm_op_on_the_buffer_and_copies_nothing():
    """Compiled as tc_piecewise compiles a piece: the generated code passes the buffer to the
    op and has no copy of the new residual (a piece that returned the op's fresh tensor would
    copy it into the buffer)."""
    from torch._inductor.utils import run_and_get_code

    sub = _norm_piece()
    torch._dynamo.reset()
    fn = torch.compile(run_into(sub), dynamic=True, fullgraph=True)
    x, w, r, gamma = _norm_inputs(64)
    want = sub(x, w, r, gamma)
    big = torch.full((128, 256), float("nan"))
    (normed, new), code = run_and_get_code(fn, [None, big[:64]], x, w, r, gamma)
    src = "\n".join(code)
    assert "row_linear_add_rms_norm.default(" in src and "copy" not in src.lower()
    assert new.data_ptr() == big.data_ptr() and big[64:].isnan().all()
    assert torch.equal(big[:64], want[1]) and torch.equal(normed, want[0])

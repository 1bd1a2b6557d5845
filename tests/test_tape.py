"""Segment runners replay a bucket from its tape: the graphs and the attention calls, in order,
with nothing in between (``runners/tape.py``). These pin, on CPU:

- a replay never comes back through the model's ``attend``, the bound attention's per-call
  path, a piece module or the split graph's code, yet equals eager and counts every graph;
- which attention calls share one launch (``launch_groups``);
- the recording below FlashInfer's Python (``innermost``, ``recorded_launch(execute=False)``),
  with stand-ins for its module function and compiled kernel;
- a capture whose attention or split graph a tape could not replay fails, with the reason.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx

from service.buckets import decide_replay
from service.errors import CaptureFailed
from service.model import llama
from service.model.attention import AttendCall, AttentionKey
from service.ranks.attention.base import AttendCalls, Bound
from service.ranks.attention.flashinfer_backend import HeadShape, launch_groups
from service.ranks.attention.recorded_launch import innermost, recorded_launch
from service.ranks.runners.tape import RecordingAttention, Tape
from service.ranks.runners.tc_piecewise.pieces import PieceGraph
from service.ranks.runners.tc_piecewise.split import check_tape_structure
from tests.batches import live_batch
from tests.test_honest_replay import graph_cfg


def test_a_tape_runs_its_first_graph_before_attention_is_planned():
    """The first graph (embedding up to layer 0's attention inputs) needs no attention plan:
    it is launched before the forward's attention is resolved, so the device runs it while the
    host plans; then attention and graphs alternate, each call with its own launch."""
    log: list[str] = []
    t = torch.zeros(2, 4)
    calls = [AttendCall(t, t, t, AttentionKey(i), t) for i in range(2)]

    def step(name: str):
        return lambda: log.append(name)

    tape = Tape([step("graph0"), calls[0], step("graph1"), calls[1], step("graph2")], t)

    def resolve():
        log.append("plan")
        return [step("attend0"), step("attend1")]

    assert tape.run(resolve) is t
    assert log == ["graph0", "plan", "attend0", "graph1", "attend1", "graph2"]
    with pytest.raises(ValueError):  # one launch per attention call, no fewer
        tape.run(lambda: [step("attend0")])


@pytest.mark.parametrize("backend", ["breakable", "tc_piecewise"])
def test_a_replay_is_its_tape_and_nothing_else(backend, monkeypatch):
    from service.engine import Engine

    e = Engine(graph_cfg(backend))
    w = e.executor.worker
    lens = (37, 60, 11)
    batch = live_batch(w, lens, seed=3)
    decision = decide_replay(e.resolved.plan, sum(lens), len(lens))
    calls = w.runner.captured_calls(decision.bucket)
    with torch.inference_mode():
        want = w.eager_runner.run(batch, decision).clone()

        def boom(*args, **kwargs):
            raise AssertionError("a replay went around its tape")

        for cls, name in [
            (llama.CausalLM, "attend"),  # the model's attention step
            (Bound, "__call__"),  # the bound attention's per-call path
            (PieceGraph, "forward"),  # a piece module
        ]:
            monkeypatch.setattr(cls, name, boom)
        if backend == "tc_piecewise":  # the split graph's code
            monkeypatch.setattr(w.runner._split, "forward", boom)
        got = w.runner.run(batch, decision)
    assert torch.equal(got, want)
    assert [c.replays for c in calls] == [1] * len(calls)
    tape = w.runner._captured[decision.bucket]
    tape = getattr(tape, "tape", tape)
    assert tape.num_attention_calls == w.model.cfg.num_hidden_layers


def _call(q, k, v, layer, out) -> AttendCall:
    return AttendCall(q, k, v, AttentionKey(layer), out)


def test_ragged_calls_over_the_same_tensors_share_one_launch_whatever_the_layer():
    t = [torch.zeros(4, 8) for _ in range(5)]
    q, k, v, out0, out1 = t
    calls = AttendCalls((_call(q, k, v, 0, out0), _call(q, k, v, 1, out1), _call(q, k, v, 2, out0)))
    shapes = {AttentionKey(i): HeadShape(2, 1, 4, 0.5) for i in range(3)}
    # ragged: the layer does not matter, the output buffer does (tc_piecewise alternates two)
    assert launch_groups(calls, shapes, any_layer=True) == ([0, 1], [0, 1, 0])
    # paged: each layer reads its own cache
    assert launch_groups(calls, shapes, any_layer=False) == ([0, 1, 2], [0, 1, 2])
    # views made afresh over the same memory (tc_piecewise's pieces) are the same launch
    again = AttendCalls((_call(q, k, v, 0, out0), _call(q[:], k.view(4, 8), v, 1, out0[:4])))
    assert launch_groups(again, shapes, any_layer=True) == ([0], [0, 0])
    # another head shape is another launch
    shapes[AttentionKey(2)] = HeadShape(4, 1, 2, 0.5)
    assert launch_groups(calls, shapes, any_layer=True) == ([0, 1, 2], [0, 1, 2])


class Kernel:
    """Stands in for a compiled (tvm-ffi) kernel entry: not a Python function."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __call__(self, *args: object) -> None:
        self.calls.append(args)


def module_function(kernel: Kernel, extra_kernel: Kernel | None = None):
    """Like FlashInfer's registered op: Python around one compiled call it closes over."""

    def ragged_run(ws, q, out, scale=None):
        scale_value = 1.0 if scale is None else scale  # work the direct call skips
        kernel(ws, q, out, scale_value)
        if extra_kernel is not None:
            extra_kernel(ws)
        return out

    return ragged_run


def closed_over(fn) -> dict:
    return {
        n: c.cell_contents for n, c in zip(fn.__code__.co_freevars, fn.__closure__, strict=True)
    }


def test_innermost_makes_the_compiled_call_the_module_function_makes():
    kernel = Kernel()
    fn = module_function(kernel)
    direct = innermost(fn, ("ws", "q", "out"), {"scale": 2.0})
    assert kernel.calls == []  # recorded, not made
    assert direct.func is kernel
    direct()
    direct()
    assert kernel.calls == [("ws", "q", "out", 2.0)] * 2
    assert closed_over(fn)["kernel"] is kernel  # the real kernel is back in place


def test_innermost_keeps_the_module_function_when_it_is_not_one_compiled_call():
    kernel, other = Kernel(), Kernel()
    two = module_function(kernel, other)
    direct = innermost(two, ("ws", "q", "out"), {})
    assert direct.func is two and kernel.calls == [] and other.calls == []

    def needs_result(x):  # uses what the compiled call returns: cannot be recorded
        return kernel(x).shape

    direct = innermost(needs_result, (1,), {})
    assert direct.func is needs_result
    assert closed_over(needs_result)["kernel"] is kernel
    plain = innermost(len, ([1, 2],), {})  # no closure at all
    assert plain() == 2


def test_recording_without_executing_launches_nothing_and_records_the_kernel_call():
    kernel = Kernel()

    class Module:
        ragged_run = staticmethod(module_function(kernel))

    class Wrapper:
        _cached_module = Module()

        def run(self, q, out):
            return self._cached_module.ragged_run("ws", q, out)

    w = Wrapper()
    direct = recorded_launch(w, lambda: w.run("q", "out"), execute=False)
    assert kernel.calls == [] and isinstance(w._cached_module, Module)
    assert direct is not None and direct.func is kernel
    direct()
    assert kernel.calls == [("ws", "q", "out", 1.0)]


class FakeBound:
    decode = False

    def __init__(self, in_place: bool) -> None:
        self.in_place = in_place

    def store(self, k, v, key) -> None:
        pass

    def kv_target(self, key):
        return None

    def __call__(self, q, k, v, key, out=None):
        return out if self.in_place and out is not None else q.clone()


def test_a_capture_whose_attention_does_not_write_its_output_buffer_has_no_tape():
    q = torch.zeros(4, 8)
    steps: list = []
    ok = RecordingAttention(FakeBound(True), steps)
    ok(q, q, q, AttentionKey(0), torch.zeros(4, 8))
    ok.check()
    assert len(steps) == 1 and isinstance(steps[0], AttendCall)
    for bad, out, why in [
        (RecordingAttention(FakeBound(False), []), torch.zeros(4, 8), "outside its output"),
        (RecordingAttention(FakeBound(True), []), None, "without an output buffer"),
    ]:
        bad(q, q, q, AttentionKey(3), out)
        with pytest.raises(CaptureFailed, match=f"no replay tape: attention of .*{why}"):
            bad.check()


def test_a_split_graph_that_computes_between_its_pieces_cannot_be_taped():
    piece = fx.GraphModule(torch.nn.Module(), _graph(lambda g, x: g.call_function(torch.neg, (x,))))

    def root(extra: bool) -> fx.GraphModule:
        g = fx.Graph()
        x = g.placeholder("x")
        y = g.call_module("piece", (x,))
        if extra:
            y = g.call_function(torch.add, (y, 1))
        g.output(y)
        holder = torch.nn.Module()
        holder.piece = piece
        return fx.GraphModule(holder, g)

    check_tape_structure(root(extra=False))
    with pytest.raises(CaptureFailed, match=r"computes .*add.* between its pieces"):
        check_tape_structure(root(extra=True))


def _graph(body) -> fx.Graph:
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(body(g, x))
    return g


def test_tc_piecewise_hands_q_k_and_v_of_a_layer_to_attention_as_one_tensor():
    """Llama's q, K and V (equal K/V widths, two-part cache) leave each compiled piece as one
    tensor, the rotated qkv projection: no cat of separately rotated parts in the traced pieces
    beyond the split's own (which inductor removes), one store op per layer (one kernel for both
    cache parts) and attention over the tensor's column slices. (That a replay's cache equals
    eager's is test_graph_runners.py::test_tc_piecewise_stores_kv_inside_the_pieces.)"""
    from service.engine import Engine
    from service.ranks.runners.tc_piecewise.split import is_attention

    e = Engine(graph_cfg("tc_piecewise"))
    w = e.executor.worker
    decision = decide_replay(e.resolved.plan, 108, 3)
    layers = w.model.cfg.num_hidden_layers
    split = w.runner._split
    subs = [getattr(m, "sub", m) for m in split.children()]  # a piece's traced graph
    targets = [n.target for sub in subs for n in sub.graph.nodes if n.op == "call_function"]
    names = [getattr(t, "__name__", str(t)) for t in targets]
    assert sum("store_kv_qkv" in n for n in names) == layers
    assert not any(n.endswith("store_kv") or "store_kv." in n for n in names)
    attention = [n for sub in subs for n in sub.graph.nodes if is_attention(n)]
    assert [n.target.__name__ for n in attention] == ["direct_attention_qkv"] * layers
    # the cat that joins q, K and V reads the slices of one split, in order, and nothing else
    # does: the pattern inductor replaces by the split tensor
    joins = [
        n
        for sub in subs
        for n in sub.graph.nodes
        if n.target is torch.cat and any("store_kv_qkv" in str(u.target) for u in n.users)
    ]  # rotate-half's own cat, inside the one rotary expression, is not one of them
    assert len(joins) == layers
    for cat in joins:
        parts = cat.args[0]
        assert [p.args[1] for p in parts] == [0, 1, 2]
        assert len({p.args[0] for p in parts}) == 1 and all(len(p.users) == 1 for p in parts)
    tape = w.runner._captured[decision.bucket]
    for c in tape.calls.calls:  # q, K and V: adjacent column ranges of one tensor
        assert c.k.data_ptr() == c.q.data_ptr() + c.q.shape[1] * c.q.element_size()
        assert c.v.data_ptr() == c.k.data_ptr() + c.k.shape[1] * c.k.element_size()

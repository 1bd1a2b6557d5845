"""FlashInfer's eager attention records the one kernel call its Python ``run`` makes and makes
it directly for the next layers of a forward (``recorded_launch``). The GPU test checks it
against real kernels; these pin the contract on CPU with a stand-in wrapper, so CI covers it."""

from __future__ import annotations

import pytest

from service.ranks.attention.recorded_launch import recorded_launch


class Module:
    """A compiled module: a launch method and a plain attribute ``run`` reads."""

    plan_info = 7

    def __init__(self) -> None:
        self.launches: list[tuple] = []

    def ragged_run(self, *args: object, **kwargs: object) -> None:
        self.launches.append((*args, kwargs) if kwargs else args)


class Wrapper:
    def __init__(self, module: Module, launches: int = 1, fail: bool = False) -> None:
        self._cached_module = module
        self.launches = launches
        self.fail = fail
        self.runs = 0

    def run(self, q: object, out: object) -> object:
        self.runs += 1
        assert self._cached_module.plan_info == 7  # attributes pass through the recorder
        if self.fail:
            raise RuntimeError("shape check failed")
        for _ in range(self.launches):
            self._cached_module.ragged_run("workspace", q, out)
        return out


def test_the_one_launch_is_recorded_and_made_again_with_the_same_arguments():
    module = Module()
    w = Wrapper(module)
    q, out = object(), object()
    direct = recorded_launch(w, lambda: w.run(q, out))
    assert direct is not None
    assert w._cached_module is module  # the real module is back
    assert module.launches == [("workspace", q, out)]  # run's own launch happened once
    direct()
    direct()
    assert w.runs == 1  # the next layers skip run
    assert len(module.launches) == 3
    assert all(a[1] is q and a[2] is out for a in module.launches)


@pytest.mark.parametrize("launches", [0, 2])
def test_a_run_that_is_not_exactly_one_launch_is_not_recorded(launches):
    module = Module()
    w = Wrapper(module, launches)
    assert recorded_launch(w, lambda: w.run(1, 2)) is None
    assert w._cached_module is module and len(module.launches) == launches


def test_a_failing_run_leaves_the_real_module_in_place():
    module = Module()
    w = Wrapper(module, fail=True)
    with pytest.raises(RuntimeError, match="shape check"):
        recorded_launch(w, lambda: w.run(1, 2))
    assert w._cached_module is module


def test_a_wrapper_without_a_compiled_module_just_runs():
    calls = []
    w = type("W", (), {"_cached_module": None})()
    assert recorded_launch(w, lambda: calls.append(1)) is None
    assert calls == [1]


def test_keyword_arguments_are_recorded_and_passed_again():
    module = Module()
    w = Wrapper(module)
    w.run = lambda: w._cached_module.ragged_run("workspace", enable_pdl=True)
    direct = recorded_launch(w, w.run)
    assert direct is not None
    direct()
    assert module.launches == [("workspace", {"enable_pdl": True})] * 2

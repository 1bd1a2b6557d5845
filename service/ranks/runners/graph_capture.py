"""One captured call: a real CUDA graph on CUDA, a traced and frozen FX graph on CPU.

On CUDA, ``fn`` is warmed up on a side stream and captured into a graph; ``replay`` relaunches
the recorded kernels, and the outputs are the tensors the capture allocated, overwritten by
every replay.

On CPU there is no graph object, so the same contract is built from a trace: ``fn`` is warmed up,
then its aten ops are recorded once (:mod:`service.ranks.runners.op_trace`). Tensors ``fn`` reads
from its closure (static buffers, parameters, the KV pool) enter the trace by reference, so a
replay reads whatever was copied into them; host-side Python (branches on shapes, lengths read on
the host, attribute lookups, the model's own methods) ran once, at capture, and is frozen into
the trace exactly as a CUDA graph freezes it. A replay runs the trace and writes its results into
the outputs that capture allocated, and returns those, so a caller that kept a previous result
sees it overwritten, as with a CUDA graph. ``replays`` counts replays, so tests can prove a
prefill went through the captured call and not around it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.utils import _pytree as pytree

from service.capture_result import CaptureStat
from service.errors import CaptureFailed
from service.ranks.runners.op_trace import OpTrace, record

T = TypeVar("T")

NUM_WARMUP = 2


class CapturedCall:
    def __init__(
        self,
        fn: Callable[[], Any],
        device: torch.device,
        pool: Any = None,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        self.replays = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.traced: OpTrace | None = None
        if device.type == "cuda":
            stream = stream or torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):  # warm up off the default stream, as capture needs
                for _ in range(NUM_WARMUP):
                    fn()
            torch.cuda.current_stream(device).wait_stream(stream)
            torch.cuda.synchronize(device)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool, stream=stream):
                self.out = fn()
            torch.cuda.synchronize(device)
        else:
            fn()  # warm-up: compiles what is compiled, builds what is built lazily
            self.traced, self.out = record(fn)

    @property
    def is_cuda_graph(self) -> bool:
        return self.graph is not None

    def replay(self) -> Any:
        self.replays += 1
        if self.graph is not None:
            self.graph.replay()
        else:
            self._run_trace()
        return self.out

    def launcher(self) -> Callable[[], Any]:
        """A zero-argument replay that does not count itself (the caller adds to ``replays``):
        on CUDA the graph's own compiled replay, without torch's Python wrapper around it (a
        tape of a forward calls it once per layer)."""
        if self.graph is None:
            return self._run_trace
        compiled = getattr(torch._C, "_CUDAGraph", None)
        if compiled is not None and isinstance(self.graph, compiled):
            return compiled.replay.__get__(self.graph)
        return self.graph.replay

    def _run_trace(self) -> None:
        if self.traced is None:
            raise RuntimeError("a CPU captured call without its trace")
        fresh = pytree.tree_leaves(self.traced())
        for dst, src in zip(pytree.tree_leaves(self.out), fresh, strict=True):
            if isinstance(dst, torch.Tensor) and dst.data_ptr() != src.data_ptr():
                dst.copy_(src)


def timed_capture(
    num_tokens: int, device: torch.device, capture: Callable[[], T]
) -> tuple[T, CaptureStat]:
    """Run ``capture`` and measure it: seconds, and the device memory it added (0 on CPU). Out
    of memory becomes :class:`CaptureFailed` naming the size."""
    before = device_memory_used(device)
    t0 = time.perf_counter()
    try:
        out = capture()
    except torch.cuda.OutOfMemoryError as exc:
        raise CaptureFailed(f"out of memory capturing size {num_tokens}: {exc}") from exc
    seconds = time.perf_counter() - t0
    return out, CaptureStat(num_tokens, seconds, max(0, device_memory_used(device) - before))


def device_memory_used(device: torch.device) -> int:
    """Bytes in use on the device (0 on CPU), for per-bucket capture memory."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return total - free

"""One captured call: a real CUDA graph on CUDA, static-buffer re-execution on CPU.

On CPU there is no graph object; ``replay`` runs the same function over the same static
buffers, so everything except the graph itself (synthetic batches, buffers, warm-up, padding,
slicing) is exercised by the CPU tests. The runner reports the kind honestly ("cpu").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

NUM_WARMUP = 2


class CapturedCall:
    def __init__(
        self,
        fn: Callable[[], Any],
        device: torch.device,
        pool: Any = None,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        self.fn = fn
        self.graph: torch.cuda.CUDAGraph | None = None
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
            fn()  # warm-up
            self.out = fn()

    @property
    def is_cuda_graph(self) -> bool:
        return self.graph is not None

    def replay(self) -> Any:
        if self.graph is not None:
            self.graph.replay()
            return self.out
        return self.fn()


def device_memory_used(device: torch.device) -> int:
    """Bytes in use on the device (0 on CPU), for per-bucket capture memory."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return total - free

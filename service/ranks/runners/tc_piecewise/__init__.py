"""`tc_piecewise`: torch.compile splits the forward at attention; pieces are captured per bucket.

- :mod:`.split`: splitting the traced graph at attention, and what pieces may share;
- :mod:`.shared`: the buffers and state every piece reads;
- :mod:`.pieces`: one compiled piece, captured per bucket;
- :mod:`.runner`: tracing, capture and replay.
"""

from service.ranks.runners.tc_piecewise.runner import TcPiecewiseGraphRunner

__all__ = ["TcPiecewiseGraphRunner"]

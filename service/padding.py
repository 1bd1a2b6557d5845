"""The padding rule, in one place: padding never touches a live request's state.

KV slot ``PADDING_SLOT`` (0) is reserved: the allocators never hand it out, and every token that
is not a live request's (tokens that pad a batch up to a captured bucket or decode size, the
synthetic requests of a capture) writes its K/V there. Padded tokens also get ``input_ids = 0``
and ``positions = 0``. Request slots past the real requests of a fixed request axis (the ``full``
backend, decode graphs) are zero-length sentinels: row 0, prefix 0, no new tokens; attention
treats them as empty and their outputs are discarded.

No torch import: the coordinator's allocators and the ranks' static buffers both read it.
"""

from __future__ import annotations

PADDING_SLOT = 0  # reserved KV slot: padded and synthetic tokens write here, never a live request
PADDING_TOKEN_ID = 0  # input id of a padded token
PADDING_POSITION = 0  # position of a padded token (within every rotary table)
SENTINEL_ROW = 0  # request-pool row a sentinel slot names (it reads nothing: no tokens)


def rows_to_pad(live: int, width: int, pad_from: int) -> tuple[int, int, int]:
    """The rows a static buffer must pad after a copy wrote a batch's ``live`` rows into a view
    ``width`` rows wide (``live <= width``), when every row from ``pad_from`` on already holds
    the pad: ``(start, end, pad_from after)``, rows ``start:end`` to pad (none where equal).

    Why: a replay padded rows ``live:width`` at every step, one more device op and launch
    before the graph; only rows an earlier batch or a capture wrote need it, so a batch at
    least as long as every one since the rows were last padded needs none.
    """
    if live >= pad_from:
        return live, live, live
    end = min(width, pad_from)
    return live, end, live if end == pad_from else pad_from

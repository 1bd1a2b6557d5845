"""Logging set-up: one line per event, with the rank in every line so operators can grep."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(level: int = logging.INFO, rank: int | None = None) -> None:
    tag = f" TP{rank}" if rank is not None else ""
    fmt = f"[%(asctime)s{tag}] %(levelname)s %(name)s: %(message)s"
    root = logging.getLogger()
    root.handlers.clear()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt, datefmt="%Y-%m-%d %H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(os.environ.get("CAPTURE_SERVICE_LOG_LEVEL", level))

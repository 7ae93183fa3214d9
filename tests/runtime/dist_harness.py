"""Run a function on N gloo ranks (spawned processes) and collect what each returns.

Process start and ``import torch`` cost seconds, so tests run many configurations
inside one spawn and assert on the collected results afterwards. The machinery is
``osdp.launch`` (shared with the demo and the benchmarks); tests always use gloo.
"""
from __future__ import annotations

from osdp.launch import free_port, spawn as _spawn

__all__ = ["free_port", "spawn"]


def spawn(fn, world_size: int, *args) -> list:
    """``fn(rank, world_size, *args)`` on every rank (gloo); the per-rank results."""
    return _spawn(fn, world_size, *args, backend="gloo")

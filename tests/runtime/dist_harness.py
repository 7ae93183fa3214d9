"""Run a function on N gloo ranks and collect what each returns.

``spawn(fn, world, *args)`` runs ``fn(rank, world, *args)`` on the session's pool of
persistent ranks (``rank_pool.py``, [Note: test rank pool]): process start and
``import torch`` cost seconds, paid once per world size instead of once per test module.
Tests still run many configurations inside one call and assert on the collected results
afterwards. ``fresh=True`` starts new processes instead (``osdp.launch.spawn``, the
machinery the demo and the benchmarks use): for a test that needs processes of its own
(environment read at import, process exit, state the pool cannot put back). Either way
gloo, results in rank order, and a rank's exception comes back as a RuntimeError
carrying that rank's traceback.
"""
from __future__ import annotations

from osdp.launch import free_port, spawn as _spawn

__all__ = ["free_port", "spawn"]


def spawn(fn, world_size: int, *args, fresh: bool = False, timeout_s: float | None = None) -> list:
    """``fn(rank, world_size, *args)`` on every rank (gloo); the per-rank results.
    ``fn`` must be importable (a module-level function). ``timeout_s`` (pool only): the
    task's limit, ``OSDP_TEST_POOL_TIMEOUT_S`` (600 s) by default."""
    if fresh:
        return _spawn(fn, world_size, *args, backend="gloo")
    from .rank_pool import run

    return run(fn, world_size, *args, timeout_s=timeout_s)

"""The physical limit of a plan: its step against the step with free communication and
the step with free compute, measured on the runtime in one run.

    ratio = step / max(compute-only step, comm-only step)

1.0 means compute and communication overlap perfectly and the runtime adds nothing;
the ratio says how much of the step the schedule and the runtime's overhead cost.

* compute-only step: the same wrapped model, plan and scheduler, with every collective
  replaced by a local stand-in of the same shapes (a gather copies the rank's own shard
  into every rank's place, a reduce-scatter takes its own chunk, an all-reduce does
  nothing): the step if communication were free (the weights are finite, so the
  arithmetic costs the same).
* comm-only step: the collectives one real step issued (recorded at the runtime's entry
  points, [Note: collectives per level] in osdp/runtime/collectives.py), replayed in the
  same order, sizes and groups, one after the other with no compute: the step if
  compute were free and nothing overlapped.

The three are timed in interleaved rounds (``common.timed_rounds``) so that a load that
drifts slows them alike; medians, the slowest rank's.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from common import timed_rounds, train_step

_ENTRY_POINTS = ("all_gather_flat", "reduce_scatter_flat", "all_reduce_flat")


class _Done:
    """A finished Work (what a local stand-in returns for ``async_op=True``)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _local_gather(output, shard, group=None, async_op=False):
    output.view(-1, shard.numel()).copy_(shard.reshape(1, -1))
    return _Done() if async_op else None


def _local_reduce_scatter(output, full, group=None, async_op=False, **_):
    output.copy_(full.reshape(-1)[: output.numel()].view_as(output))
    return _Done() if async_op else None


def _local_all_reduce(tensor, group=None, async_op=False):
    return _Done() if async_op else None


@contextmanager
def _patched(**replacements):
    from osdp.runtime import collectives

    saved = {name: getattr(collectives, name) for name in replacements}
    try:
        for name, fn in replacements.items():
            setattr(collectives, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(collectives, name, fn)


@contextmanager
def local_collectives():
    """Within: the runtime communicates with no one (compute-only steps), the lockstep
    check at the end of backward (a collective too) included."""
    from osdp.runtime.lockstep_check import LockstepCheck

    start = LockstepCheck.start
    LockstepCheck.start = LockstepCheck.skip  # no comparison to finish
    try:
        with _patched(all_gather_flat=_local_gather, reduce_scatter_flat=_local_reduce_scatter,
                      all_reduce_flat=_local_all_reduce):
            yield
    finally:
        LockstepCheck.start = start


@contextmanager
def recorded_collectives(calls: list):
    """Within: every collective the runtime issues is appended to ``calls`` as
    (entry point, [(numel, dtype, device) of each tensor argument], group, keyword
    arguments), then issued."""
    from osdp.runtime import collectives

    originals = {name: getattr(collectives, name) for name in _ENTRY_POINTS}

    def recorder(name):
        def issue(*args, group=None, async_op=False, **kwargs):
            if name == "all_reduce_flat" and len(args) > 1:  # (tensor, group, async_op)
                args, group, async_op = args[:1], args[1], (args[2] if len(args) > 2 else async_op)
            calls.append((name, [(t.numel(), t.dtype, t.device) for t in args], group, kwargs))
            return originals[name](*args, group=group, async_op=async_op, **kwargs)
        return issue

    with _patched(**{name: recorder(name) for name in _ENTRY_POINTS}):
        yield


def _replay(calls, buffers) -> None:
    from osdp.runtime import collectives

    for (name, _, group, kwargs), tensors in zip(calls, buffers):
        work = getattr(collectives, name)(*tensors, group=group, async_op=True, **kwargs)
        if work is not None:
            work.wait()


def physical_limit(model, optim, config, batch: int, rounds: int) -> dict:
    """{step_s, compute_only_s, comm_only_s, ratio} of ``model`` (an ``osdp.OSDP``
    module) training at ``batch``; see the module docstring."""
    train_step(model, optim, config, batch, seed=0)  # warm-up: use order, optimizer state
    calls: list = []
    with recorded_collectives(calls):
        train_step(model, optim, config, batch, seed=1)
    buffers = [[torch.empty(numel, dtype=dtype, device=device) for numel, dtype, device in shapes]
               for _, shapes, _, _ in calls]
    with local_collectives():
        train_step(model, optim, config, batch, seed=2)  # warm-up of the compute-only path

    def compute_only(r):
        with local_collectives():
            train_step(model, optim, config, batch, seed=10 + r)

    steps = {"step_s": lambda r: train_step(model, optim, config, batch, seed=10 + r),
             "compute_only_s": compute_only,
             "comm_only_s": lambda r: _replay(calls, buffers)}
    out = dict(zip(steps, timed_rounds(list(steps.values()), rounds)))
    out["ratio"] = out["step_s"] / max(out["compute_only_s"], out["comm_only_s"])
    out["collectives"] = len(calls)
    return out

"""The prefetch window and the bytes the runtime can gather ahead of each op within it
(docs/design/cost_model.md's [Note: memory model]).

[Note: prefetch bounds]
The runtime's prefetch is ``osdp.schedule_rules.prefetch_walk`` (and its coalescing
``riders``, whose gathers count in the same window): walk the use order from the next
use, skip what is gathered, issue while the transient bytes plus the next unit's stay
within the window, stop at the first that does not fit. The closed forms here are
bounds of that walk, not a second copy of it: ``_ahead_bytes`` is the most the walk can
hold ahead of an op (the following ops' bytes, capped by the window; the walk may stop
earlier at a unit that does not fit whole, never later), and ``_forward_prefetch`` the
part of it beside a use that counts itself in the window. Two things beside the
window's bytes: a coalesced group's staging buffer (``_staged_ahead``), and, in
backward, the window refilled at a use's own release while its gradient is still live
(options.py ``_backward_gathers``). The exact bytes, op by op, come from the step
simulation, which runs the walk itself (``step_sim.gathered_at_compute``, [Note: exact
gathers] in memory.py); a bound below them let the search return plans that did not
fit (tests/planner/test_gathers_bound.py holds every op of random plans to it).
"""
from __future__ import annotations

import math

from ...contract import is_small_unit
from ..model_desc import ModelDesc
from .replicate import rep_op_mask
from .settings import PlannerSettings, slice_choices
from .unit_bytes import gathered_bytes

WINDOW_BUDGET_SHARE = 1 / 50


def prefetch_window(desc: ModelDesc, settings: PlannerSettings, budget_bytes: float = math.inf) -> float:
    """Default: room for two slices of the largest op, each op cut only as finely as
    needed for a slice to stay within 2% of the memory budget (so a model whose units
    are all small overlaps every gather unsplit, and a giant op still overlaps once
    split). Unsplittable ops do not set it: they run with their gather exposed rather
    than inflate every op's window."""
    if settings.prefetch_bytes is not None:
        return float(settings.prefetch_bytes)
    cap = budget_bytes * WINDOW_BUDGET_SHARE
    rep = rep_op_mask(desc, settings)  # rep units are never gathered
    slices = []
    for i, op in enumerate(desc.ops):
        if op.splittable and not rep[i]:
            sizes = [gathered_bytes(op, settings) / g for g in slice_choices(op, settings)]
            slices.append(next((size for size in sizes if size <= cap), sizes[-1]))
    if not slices:
        slices = [gathered_bytes(op, settings) for i, op in enumerate(desc.ops) if not rep[i]]
    return 2.0 * max(slices, default=0.0)


def _ahead_bytes(desc: ModelDesc, window: float, settings: PlannerSettings) -> tuple[list[float], list[float]]:
    """Bytes that can be gathered ahead of each op: the following ops in forward, the
    preceding ones in backward, capped by the window: an upper bound of what
    ``schedule_rules.prefetch_walk`` issues there ([Note: prefetch bounds])."""
    sizes = _gathered_sizes(desc, settings)
    return _ahead_of(sizes, window), _ahead_of(sizes[::-1], window)[::-1]


def _gathered_sizes(desc: ModelDesc, settings: PlannerSettings) -> list[float]:
    """Per op, the bytes the walk gathers for it: none for a tied use (its owner's
    gather) or a rep unit (never gathered)."""
    rep = rep_op_mask(desc, settings)
    return [gathered_bytes(op, settings) if not (op.tied_to or rep[i]) else 0 for i, op in enumerate(desc.ops)]


def _staged_ahead(desc: ModelDesc, window: float, settings: PlannerSettings,
                  world_size: int) -> tuple[list[float], list[float]]:
    """Per op, the most the staging buffers of coalesced gathers issued ahead of it can
    hold (forward, backward): a group of small units is gathered rank-major into one
    buffer and copied out at its first wait (runtime/collectives.py), so beside an op
    a prefetched group holds its bytes twice. At most the small units among the ops the
    walk can hold ahead (``_ahead_bytes``), capped by the window; none where nothing
    coalesces (one rank, ``coalesce_bytes`` 0). The gathers a bound adds it to are its
    cap too: the buffer copies a part of them."""
    n = len(desc.ops)
    if world_size <= 1 or settings.coalesce_bytes <= 0:
        return [0.0] * n, [0.0] * n
    small = [size if size > 0 and is_small_unit(size, settings.coalesce_bytes, is_slice=False) else 0.0
             for size in _gathered_sizes(desc, settings)]
    return _ahead_of(small, window), _ahead_of(small[::-1], window)[::-1]


def _ahead_of(sizes: list[float], window: float) -> list[float]:
    """Per position, the sum of the sizes after it, capped by ``window``."""
    out, acc = [0.0] * len(sizes), 0.0
    for i in range(len(sizes) - 1, -1, -1):
        out[i] = min(window, acc)
        acc = min(window, acc + sizes[i])
    return out


def _forward_prefetch(s: float, window: float, after: float) -> float:
    """Bytes prefetched beside a forward use of a slice of ``s`` bytes, ``after`` being
    what the next ops could gather (``_ahead_bytes``): the window holds the slice in
    use too, kept dp or not (runtime/prefetch.py gathers it counting the unit in use,
    [Note: transient bytes] in lifecycle.py); the slice itself is counted by the caller
    (as a gather, or in the prefix when kept). In backward the window is filled at the
    previous use's release, when nothing of this op is in use: there a dp slice
    leaves the whole window to prefetches (``min(window, own + before)``)."""
    return 0.0 if s > window else min(window - s, after)

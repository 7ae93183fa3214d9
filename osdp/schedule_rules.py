"""The runtime's scheduling DECISIONS, written once (issue 34): which units a prefetch
issues, which small units ride along with a gather, when small units' gradients are
reduced together, when a replicated bucket is all-reduced, and how many reductions stay
in flight. The runtime (``osdp/runtime/prefetch.py``'s ``PrefetchPolicy``,
``osdp/runtime/reduce.py``'s ``GradReducer``) makes these decisions by calling the
functions here, and so does the planner's step simulation (``osdp/planner/step_sim.py``'s
``_Sim``); the cost model's closed forms (``cost_model/prefetch.py``, ``timing.py``'s
[Note: coalesced latency], ``replicate.py``'s buckets) are bounds of them, or call them.

Pure functions over plain data: no torch, no runtime or planner class. A unit is whatever
the caller holds (a ``ShardUnit``, a simulator unit); the caller says how to read it
through small accessors (its bytes, its group key, whether it may ride), so neither side
builds views in its hot loops. The rules and their reasons are documented where the
runtime implements the mechanics: [Note: prefetch window] and [Note: coalesced small
units] in runtime/prefetch.py, [Note: unsharded gradients], [Note: coalesced reductions]
and [Note: replicated buckets] in runtime/reduce.py, [Note: replicated units] in
contract.py. This module imports nothing from osdp but the contract's constants (and
tests/test_boundaries.py checks that it never imports torch, the runtime or the planner).
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import TypeVar

U = TypeVar("U")


# ---- the prefetch window ([Note: prefetch window]) ------------------------------------------
def prefetch_walk(candidates: Iterable[tuple[int, U]], window_bytes: float, *,
                  size: Callable[[U], float], transient: Callable[[], float],
                  skip: Callable[[int, U], bool]) -> Iterator[int]:
    """The positions a prefetch issues, in order: walk ``candidates`` (``(position, unit)``
    of the use order from the next use on), skip the units ``skip`` says (already
    gathered, a use that gathers nothing), issue each while ``transient()`` (the
    transient gathered bytes NOW) plus its ``size`` stays <= ``window_bytes``, and stop
    at the first that does not fit. A generator: the caller issues each position it
    yields (with its riders) before the next candidate is looked at, so ``transient``
    and ``skip`` see every issue before it; ``candidates`` may be lazy for the same
    reason. ``window_bytes <= 0``: nothing."""
    if window_bytes <= 0:
        return
    for pos, unit in candidates:
        if skip(pos, unit):
            continue
        if transient() + size(unit) > window_bytes:
            return
        yield pos


# ---- coalesced gathers ([Note: coalesced small units]) ---------------------------------------
def riders(lead: U, following: Iterable[U], coalesce_bytes: float, room: float, *,
           size: Callable[[U], float], key: Callable[[U], Hashable],
           eligible: Callable[[U], bool]) -> list[U]:
    """The units that ride along in ``lead``'s gather (``lead`` a small unit issued with
    a known order): ``following`` are the units after it in the use order; those not
    ``eligible`` (not small, or not still sharded) and repeats (units are hashable, by
    identity) are skipped; the walk
    stops at the first unit whose ``key`` differs from the lead's (its gathered dtype,
    or the level it gathers from: shards or node copies), or whose ``size`` exceeds what
    is left of ``coalesce_bytes`` (the lead's bytes included) or of ``room`` (the window
    left beside the lead's gather)."""
    budget = coalesce_bytes - size(lead)
    room = room - size(lead)
    group_key = key(lead)
    out: list[U] = []
    seen = {lead}
    for other in following:
        if other in seen or not eligible(other):
            continue
        nbytes = size(other)
        if key(other) != group_key or nbytes > min(budget, room):
            break
        out.append(other)
        seen.add(other)
        budget -= nbytes
        room -= nbytes
    return out


def coalesced_groups(sizes: Sequence[float], coalesce_bytes: float,
                     rooms: Sequence[float] | None = None) -> list[list[int]]:
    """Indices of ``sizes`` (small units in use order, all sharded, one key) grouped as
    gathers issue them: each group a lead and its :func:`riders`; ``rooms[i]``: the
    window left when a gather led by unit ``i`` issues (None: unbounded). The packing
    [Note: coalesced latency] in cost_model/timing.py prices."""
    groups, i = [], 0
    while i < len(sizes):
        ride = riders(i, range(i + 1, len(sizes)), coalesce_bytes, float("inf") if rooms is None else rooms[i],
                      size=sizes.__getitem__, key=lambda _: 0, eligible=lambda _: True)
        groups.append([i] + ride)
        i += 1 + len(ride)
    return groups


# ---- gradients: coalesced reductions, replicated buckets, reductions in flight -------------
def group_full(filled_bytes: float, limit_bytes: float) -> bool:
    """Whether a group filling up is issued now: the small units' deferred gradients
    (``limit_bytes``: coalesce_bytes, [Note: coalesced reductions]) or a replicated
    bucket (REPLICATE_BUCKET_BYTES, [Note: replicated buckets]), once ``filled_bytes``
    (the joined gradients' bytes, the newest included) reach the limit; the rest is
    issued at the end of the backward pass."""
    return filled_bytes >= limit_bytes


def pack_buckets(sizes: Sequence[float], bucket_bytes: float) -> list[list[int]]:
    """Indices of ``sizes`` (gradients in join order) per bucket, in issue order, by
    :func:`group_full`: the last bucket is the one the end of backward flushes."""
    buckets, current, filled = [], [], 0.0
    for i, nbytes in enumerate(sizes):
        current.append(i)
        filled += nbytes
        if group_full(filled, bucket_bytes):
            buckets.append(current)
            current, filled = [], 0.0
    if current:
        buckets.append(current)
    return buckets


def by_key(units: Iterable[U], key: Callable[[U], Hashable]) -> list[list[U]]:
    """``units`` split into one collective per ``key`` (reduce dtype), in order of first
    appearance, each in join order: how a flush of deferred small gradients issues."""
    groups: dict = {}
    for unit in units:
        groups.setdefault(key(unit), []).append(unit)
    return list(groups.values())


def waits_after_issue(in_flight: int, max_in_flight: int) -> int:
    """How many of the oldest collectives to wait for once one more was issued and
    ``in_flight`` (it included) are in flight: the reduce-scatter queue ([Note:
    unsharded gradients], MAX_INFLIGHT_REDUCE_SCATTERS)."""
    return max(0, in_flight - max_in_flight)


def waits_before_issue(in_flight: int, max_in_flight: int) -> int:
    """How many of the oldest to wait for before issuing one more when ``in_flight`` are
    in flight: the replicated buckets' queue (MAX_INFLIGHT_REPLICATE_BUCKETS), which
    waits first so that two buckets' staging copies are never live at once."""
    return max(0, in_flight + 1 - max_in_flight)

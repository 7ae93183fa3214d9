"""Re-rank a few of the planner's plans by their simulated step (``step_sim``).

[Note: re-ranking]
The exact search optimizes the additive cost model (one max(compute, comm) per op, see
docs/design/cost_model.md's [Note: time model]); the runtime overlaps across ops, serializes
collectives on one stream, coalesces small units, stalls on the reduction queue and
regathers for checkpoint recomputes. So the search's optimum is re-checked against a
few strong alternatives, each priced by ``simulate_step``:

- the search's best plan (``scheduler.schedule``), and the best plan at each of the next
  ``rerank_batches - 1`` batch sizes by the cost model's samples/s among probes near
  the optimum b (b+1, b+2 while feasible, b-1, b-2, 3b/4, b/2; one exact search each;
  only when the batch is swept, not given);
- the baseline configurations that lie inside the user's settings: all ``zdp`` (FSDP
  full shard) and all ``dp`` (shard-grad-op) when the policy is "osdp" (and its
  ``rep_units``, if fixed, are none), all ``rep`` (DDP) when it is "osdp" choosing its
  rep units (``rep_units`` None), FSDP with every
  block checkpointed when checkpointing is "auto" or "all" (and without it when it is
  "auto" or "none"), each at its own best batch (or the given batch / global batch);
  and the search without splitting (max_slices=1) when splitting is allowed, at the
  search's batch and accumulation (a sweep of its own would cost as much as the main
  one: its option space is as large but for the slices).

Each of them is also priced at a wider prefetch window when that could change it
([Note: window choice]). The one with the most simulated samples/s whose exact peak
memory fits (the cost model's ``evaluate``) is picked; ties keep the earlier
candidate, the search's best first. Identical plans are simulated once. Nothing
outside the settings is ever picked: a user who said checkpointing="none" gets no
checkpointed plan.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from ..errors import InfeasiblePlanError
from .cost_model import PlannerSettings, build_template, evaluate, gathered_bytes
from .model_desc import ModelDesc
from .device import DeviceInfo
from .batch_sweep import Scheduled, beat_bound, schedule, search_batch
from .search import evaluate_assignment, feasible
from .search_problem import SearchResult
from .step_sim import StepSim, simulate_scheduled

# name -> settings overrides of a baseline configuration (names as in make_plan's baselines)
CONFIGS = {
    "fsdp": dict(policy="zdp", checkpointing="none"),
    "shard_grad_op": dict(policy="dp", checkpointing="none"),
    "fsdp_ckpt": dict(policy="zdp", checkpointing="all"),
    "ddp": dict(policy="rep", checkpointing="none"),
    "osdp_unsplit": dict(max_slices=1),
}
AT_SEARCH_BATCH = {"osdp_unsplit"}  # searched at the search's batch, not swept


@dataclass(frozen=True)
class Candidate:
    name: str
    scheduled: Scheduled
    sim: StepSim

    @property
    def fits(self) -> bool:
        return bool(self.scheduled.estimate.fits)

    @property
    def predicted_samples_per_s(self) -> float:
        return self.scheduled.samples_per_s

    @property
    def simulated_samples_per_s(self) -> float:
        s = self.scheduled
        return s.batch * s.accumulation_steps * s.template.device.world_size / self.sim.step_s

    def row(self) -> dict:
        s = self.scheduled
        return {
            "name": self.name,
            "batch_size": int(s.batch),
            "accumulation_steps": int(s.accumulation_steps),
            "predicted_step_s": float(s.result.time_s),
            "simulated_step_s": float(self.sim.step_s),
            "exposed_comm_s": float(self.sim.exposed_comm_s),
            "predicted_samples_per_s": float(self.predicted_samples_per_s),
            "simulated_samples_per_s": float(self.simulated_samples_per_s),
            "peak_bytes": float(s.estimate.peak_bytes),
            "fits": self.fits,
        }


@dataclass(frozen=True)
class Reranked:
    picked: Candidate
    candidates: tuple[Candidate, ...]
    searches: int  # exact searches run for the candidates (baseline sweeps included)
    rerank_s: float  # wall time of finding and simulating them

    def report(self) -> dict:
        """What a Plan stores (JSON-friendly: lists and dicts only)."""
        return {
            "picked": self.picked.name,
            "candidates": [c.row() for c in self.candidates],
            "searches": self.searches,
            "rerank_s": self.rerank_s,
        }


def within(settings: PlannerSettings, overrides: dict) -> bool:
    """Whether a configuration restricts the user's search space (never widens it)."""
    policy = overrides.get("policy", settings.policy)
    if settings.policy != "osdp" and policy != settings.policy:
        return False
    if settings.policy == "osdp" and settings.rep_units is not None and policy != "osdp":
        # the user fixed which units are rep: DDP only if that is every unit (not known
        # here: never), the sharded policies only if it is none
        if policy == "rep" or settings.rep_units:
            return False
    ckpt = overrides.get("checkpointing", settings.checkpointing)
    if settings.checkpointing != "auto" and ckpt != settings.checkpointing:
        return False
    return overrides.get("max_slices", settings.max_slices) <= settings.max_slices


def _key(s: Scheduled) -> tuple:
    """Identity of what the runtime would run."""
    t = s.template
    options = tuple(t.shape(o) for o in s.result.option_index)
    ckpt = tuple(i for seg, v in zip(t.segments, s.result.variant) if seg.variants[v] for i in seg.ops)
    return (s.batch, s.accumulation_steps, int(t.window_bytes), options, ckpt, t.settings.layout, t.rep_units)


def _nearby_batches(best: Scheduled, count: int, backend: str) -> tuple[list[Scheduled], int]:
    """The best plan at each of the ``count`` batch sizes, among probes near the sweep's
    optimum, with the most predicted samples/s (exact search at each probe)."""
    if count <= 0:
        return [], 0
    t, b = best.template, best.batch
    down = sorted({b - 1, b - 2, (3 * b + 3) // 4, (b + 1) // 2} - {b}, reverse=True)
    found = []

    def probe(p: int) -> bool:
        """Whether anything fits at ``p``; its best plan joins ``found`` if it can be
        among the ``count`` best: once ``count`` are found, only by beating the last of
        them (the sort below is stable, an equal rate stays behind), so the search is
        told that bound and skips the states that cannot."""
        started = time.perf_counter()
        if not feasible(t.problem(p), backend=backend):
            return False
        rates = sorted((s.samples_per_s for s in found), reverse=True)
        per_batch = best.accumulation_steps * t.device.world_size  # samples/s = batch / step_s * this
        bound = beat_bound(p, rates[count - 1] / per_batch) if len(rates) >= count else math.inf
        r = search_batch(t, p, backend, time_bound=bound)
        if r.feasible:
            estimate = evaluate(t, p, r.option_index, r.variant)
            found.append(Scheduled(t, p, r, estimate, 1, time.perf_counter() - started))
        return True

    searches = 1
    if probe(b + 1):  # memory grows with the batch: b + 2 fits only if b + 1 does
        searches += 1
        probe(b + 2)
    for p in down:
        if p >= 1:
            searches += 1
            probe(p)
    found.sort(key=lambda s: -s.samples_per_s)
    return found[:count], searches


def widest_slice_bytes(s: Scheduled) -> float:
    """Gathered bytes of the largest slice the plan gathers (rep units never gather; a
    tied use is gathered as its owner)."""
    t, o = s.template, s.result.option_index
    return max((gathered_bytes(op, t.settings) / t.shape(o[i])[0] for i, op in enumerate(t.desc.ops)
                if op.param_count and not op.tied_to and not (t.rep is not None and t.rep[i])), default=0.0)


def with_window(s: Scheduled, window_bytes: float) -> Scheduled:
    """The same assignment (slices, modes, checkpointed blocks, batch) under a template
    whose prefetch window is ``window_bytes``: its memory and time priced again."""
    t = s.template
    wide = build_template(t.desc, t.device, t.settings.with_(prefetch_bytes=float(window_bytes)))
    option_index = []
    for i, o in enumerate(s.result.option_index):
        v = int(t.opt_variant[o])
        option_index.append(next(p for p in range(wide.opt_begin[i, v], wide.opt_end[i, v])
                                 if wide.shape(p) == t.shape(o)))
    variant = tuple(s.result.variant)
    _, time_s, peak, peak_op = evaluate_assignment(wide.problem(s.batch), option_index, variant)
    result = SearchResult(True, time_s, peak, peak_op, tuple(option_index), variant)
    return Scheduled(wide, s.batch, result, evaluate(wide, s.batch, option_index, variant), 0, 0.0, s.batch_capped)


def _wider_window(s: Scheduled) -> Scheduled | None:
    """[Note: window choice]
    The template's prefetch window is set before the search (``prefetch_window``: two
    slices of the largest op cut finely enough for 2% of the budget), so when the search
    leaves a big op whole, that op's gather does not fit the window and runs exposed:
    the runtime prefetches the next unit only while the gathered bytes plus its own stay
    within the window ([Note: prefetch window]). W&S 2x768 at 271 MiB: its unsplit
    9 MiB Linears under a 6.8 MiB window; simulated 5-6% slower than under 18 MiB, at
    the same batch and a peak 0-11 MiB higher. So each candidate is also priced under
    the window that prefetches every one of its gathers one use ahead, twice its
    widest gathered slice, when that is wider than the template's: its exact peak (the
    plan's own gathers, [Note: exact gathers]) says whether it still fits, the
    simulation what it gains. Only when the user left the window to the planner (the
    caller checks)."""
    wide = 2.0 * widest_slice_bytes(s)
    if wide <= s.template.window_bytes:
        return None
    return with_window(s, wide)


def rerank(
    desc: ModelDesc,
    device: DeviceInfo,
    settings: PlannerSettings,
    best: Scheduled,
    *,
    batch: int | None = None,
    global_batch: int | None = None,
    backend: str = "auto",
    known: dict[str, Scheduled] | None = None,
    **sim_kwargs,
) -> Reranked:
    """Candidates around ``best`` (see [Note: re-ranking]), each simulated; the one
    with the most simulated samples/s that fits. ``known``: baseline configurations
    already scheduled under the same batch arguments, by ``CONFIGS`` name (reused)."""
    started = time.perf_counter()
    known = known or {}
    named: list[tuple[str, Scheduled]] = [("search", best)]
    searches = 0
    if batch is None and global_batch is None:
        nearby, probes = _nearby_batches(best, settings.rerank_batches - 1, backend)
        searches += probes
        named += [(f"search@batch={s.batch}", s) for s in nearby]
    for name, overrides in CONFIGS.items():
        if not within(settings, overrides) or settings.with_(**overrides) == settings:
            continue
        if name in AT_SEARCH_BATCH and settings.policy != "osdp":
            continue  # zdp / dp policies never split: the search's plan already is unsplit
        s = known.get(name)
        if s is None:
            try:
                if name in AT_SEARCH_BATCH:
                    config = settings.with_(**overrides, accumulation_steps=best.accumulation_steps)
                    s = schedule(desc, device, config, batch=best.batch, backend=backend)
                else:
                    s = schedule(desc, device, settings.with_(**overrides), batch=batch, backend=backend,
                                 global_batch=global_batch)
            except InfeasiblePlanError:
                continue
            searches += s.searches
        named.append((name, s))
    if settings.prefetch_bytes is None:  # a window the user gave is theirs
        named += [(f"{name}+window", w) for name, s in named if (w := _wider_window(s)) is not None]
    seen: dict[tuple, StepSim] = {}
    candidates = []
    for name, s in named:
        key = _key(s)
        if key in seen:
            continue
        seen[key] = simulate_scheduled(s, **sim_kwargs)
        candidates.append(Candidate(name, s, seen[key]))
    fitting = [c for c in candidates if c.fits] or candidates[:1]
    picked = fitting[0]
    for c in fitting[1:]:
        if c.simulated_samples_per_s > picked.simulated_samples_per_s:
            picked = c
    return Reranked(picked, tuple(candidates), searches, time.perf_counter() - started)


def with_simulation(prediction, sim: StepSim, scheduled: Scheduled):
    """A plan ``Prediction`` with the simulated step beside the cost model's."""
    s = scheduled
    rate = s.batch * s.accumulation_steps * s.template.device.world_size / sim.step_s
    phases = {name: float(p.duration_s) for name, p in sim.phases.items()}
    return replace(prediction, simulated_step_s=float(sim.step_s), simulated_samples_per_s=float(rate), phases=phases)

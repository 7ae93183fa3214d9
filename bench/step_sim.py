"""Step-simulator speed: how long pricing ~50 candidate plans of a ~100-op model takes.

    python bench/step_sim.py            # GPT 16x1024 seq 256 (100 ops), the default (paper's TITAN RTX) profile, 24 GiB

Candidates are the search's best plan at each batch size from 1 up (distinct plans,
splits included where memory forces them) plus the baselines, 50 in all when that many
batches fit; then two synthetic worst cases with every op cut into 4 and 16 slices.
Prints CPU and wall milliseconds per candidate and for all 50 (median of 5 passes).
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from osdp.models import GPTConfig  # noqa: E402
from osdp.planner.cluster import DEFAULT_CLUSTER, load_cluster  # noqa: E402
from osdp.planner.cost_model import PlannerSettings, build_template, evaluate  # noqa: E402
from osdp.planner.gpt_desc import describe_gpt  # noqa: E402
from osdp.planner.run import RunSettings  # noqa: E402
from osdp.planner.batch_sweep import Scheduled, schedule, search_batch  # noqa: E402
from osdp.planner.search_problem import SearchResult  # noqa: E402
from osdp.planner.step_sim import simulate_scheduled  # noqa: E402

GIB = 24  # enough memory for ~50 batch sizes


def candidates(desc, device, settings, count=50):
    t = build_template(desc, device, settings)
    found = []
    for b in range(1, 4 * count):
        r = search_batch(t, b)
        if not r.feasible:
            break
        found.append(Scheduled(t, b, r, evaluate(t, b, r.option_index, r.variant), 1, 0.0))
    for overrides in (dict(policy="zdp"), dict(policy="dp"), dict(max_slices=1)):
        found.append(schedule(desc, device, settings.with_(**overrides)))
    return found[-count:]


def forced(t, batch, g_max):
    """Every op in the most slices <= g_max, half of them zdp."""
    choice = []
    for i in range(len(t.desc.ops)):
        opts = list(range(t.opt_begin[i, 0], t.opt_end[i, 0]))
        g = max(int(t.opt_slices[o]) for o in opts if t.opt_slices[o] <= g_max)
        choice.append(next(o for o in opts if t.opt_slices[o] == g and t.opt_zdp[o] == g // 2))
    variant = (0,) * len(t.segments)
    est = evaluate(t, batch, choice, variant)
    return Scheduled(t, batch, SearchResult(True, est.step_s, est.peak_bytes, est.peak_op, tuple(choice), variant),
                     est, 0, 0.0)


def timed(plans, passes=5):
    """Median (CPU seconds, wall seconds) of a pass over ``plans``: CPU time is what the
    code costs; wall time also counts waiting for a core on a shared machine."""
    cpu, wall = [], []
    for _ in range(passes):
        start_cpu, start = time.process_time(), time.perf_counter()
        for s in plans:
            simulate_scheduled(s)
        cpu.append(time.process_time() - start_cpu)
        wall.append(time.perf_counter() - start)
    return statistics.median(cpu), statistics.median(wall)


def main():
    desc = describe_gpt(GPTConfig(vocab_size=50257, seq_len=256, num_layers=16, hidden=1024, heads=16))
    cluster = load_cluster(DEFAULT_CLUSTER)
    device = cluster.for_run(RunSettings(world_size=cluster.node_size, memory_limit_bytes=GIB * 2**30))
    settings = PlannerSettings()
    plans = candidates(desc, device, settings)
    units = [sum(int(s.template.opt_slices[o]) for o in s.result.option_index) for s in plans]
    cpu, wall = timed(plans)
    print(f"{desc.name}: {len(desc.ops)} ops, {device.name} at {GIB} GiB")
    print(f"{len(plans)} candidates ({min(units)}-{max(units)} units each): {cpu * 1e3:.1f} ms CPU "
          f"({wall * 1e3:.1f} ms wall) in all, {cpu / len(plans) * 1e3:.2f} ms CPU per candidate")
    t = plans[0].template
    for g in (4, 16):
        s = forced(t, 2, g)
        n = sum(int(t.opt_slices[o]) for o in s.result.option_index)
        cpu, wall = timed([s] * 10)
        print(f"every op in up to {g} slices ({n} units): {cpu / 10 * 1e3:.2f} ms CPU per candidate, "
              f"{5 * cpu * 1e3:.0f} ms CPU for 50 ({5 * wall * 1e3:.0f} ms wall)")


if __name__ == "__main__":
    main()

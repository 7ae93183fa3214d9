"""What ``torch.compile`` gains OSDP and FSDP2 at equal memory (issue 33): OSDP's plan
run eager and compiled at both of its scopes (``compile=dict(scope="blocks")``: each
block and each unit outside them a graph; ``scope="model"``: one graph; inductor)
against FSDP2 (``fully_shard`` per block + root) eager and compiled the torchtitan way
(each block ``.compile()``-d after ``fully_shard``), per GPT family at the middle memory
budget. Each OSDP scope is judged against FSDP2 on its own.

    python bench/compile.py            # N&D and W&S GPT families, middle budget, 2 ranks
    python bench/compile.py --quick    # one model, few steps (a smoke run)

Per model, in ONE spawned run (so that the ratios come from one interleaved run):

- OSDP: auto mode at the budget (profile + plan, as bench/throughput.py), wrapped eager
  at its plan's batch, whose eager peak is measured (the runtime's tracker); and for
  each scope of ``--osdp-scopes`` auto mode with that ``compile=`` (what a user who
  compiles gets: its finalists measured compiled, [Note: compiled plans] in
  osdp/compiled_choice.py), wrapped compiled at its own plan's batch. Until 2026-11-28
  the compiled peers ran the eager plan, as ``--compiled-plan eager`` still does (no
  compiled auto mode: shorter, as bench/gpu_check.sh needs it).
- FSDP2 (ZeRO-3): the largest batch whose eager peak fits the budget (live-tensor
  tracker, as bench/throughput.py); the compiled FSDP2 model runs at that same batch.
- FSDP2 compiled runs at its eager batch; OSDP compiled at its compiled auto plan's.
  Memory, two measures: ``peak`` (eager peers: live tensors, the planner's and the
  runtime's measure on CPU, against which ``fits`` is judged; FSDP2's is the one its
  batch was found by) and ``alloc`` (every peer, in its third step, a steady one before
  the timed rounds: the allocator's bytes, from its reports to the profiler on CPU,
  [Note: CPU allocator peak] in osdp/memtrack.py, which also see compiled code's
  buffers and the backends' own, e.g. gloo's). ``alloc`` compiled / eager says what
  compiling did to a peer's memory; until 2026-11-28 a compiled step's memory was not
  measured at all.
- Each model's first step is timed on its own (the compile, for compiled peers); then
  every peer's steps are interleaved (common.interleaved_step_s: one warm-up step each,
  then ``--steps`` rounds) and the medians taken. Compile time = first step - median
  steady step (on eager peers the same difference is the first step's own overhead:
  optimizer state, allocator warm-up).
- ``dynamic=False`` for both compiled peers: their blocks share ``nn.Module._call_impl``'s
  code object, and dynamo's automatic-dynamic would otherwise mark the batch dimension
  dynamic for whichever peer compiles second when the two batches differ.
- Inductor's caches go to a fresh folder per run (``TORCHINDUCTOR_CACHE_DIR``), and each
  compiled peer's first step runs under ``torch._inductor.utils.fresh_cache`` (a folder
  of its own, in-memory caches cleared), so that each compile time is a cold one. Before
  (until 2026-11-27) both peers shared one: FSDP2's block kernels (layer norm, softmax,
  GELU, the same code as OSDP's) were cache hits from OSDP's compile, which runs first,
  and FSDP2's compile time read several times shorter than a cold one.

Targets (issue 33), printed next to the numbers: OSDP's compile gain (compiled samples/s
/ eager samples/s, each at its own plan's batch; for FSDP2, one batch: eager step /
compiled step) >= FSDP2's; OSDP compiled >= 1.0x FSDP2 compiled in samples/s. An error
from the compiler (or a peer that does not fit) is reported in the table and the CSV;
the other peers go on. Writes bench/results/compile_<device>.csv.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from common import (ROOT, allocator_peak_bytes, interleaved_step_s, largest_fitting_batch, measured_peak_bytes,
                    spawn, train_step, wrap_peer, write_csv)
from throughput import BUDGETS, GPT_params, MODELS

from osdp.models import GPTConfig
from osdp.rank_agreement import max_over_ranks
from osdp.runtime.compile_config import SCOPES

# (label, wrap_peer's peer, compile scope: None = eager). OSDP compiles at both scopes
# (``CompileConfig.scope``); FSDP2 per block, as torchtitan does (its hooks stay eager)
PEERS = (("osdp", "osdp", None), ("osdp_compiled", "osdp", "blocks"), ("osdp_compiled_model", "osdp", "model"),
         ("fsdp2", "fsdp_zero3", None), ("fsdp2_compiled", "fsdp_zero3", "blocks"))
OSDP_COMPILED = tuple(label for label, peer, scope in PEERS if peer == "osdp" and scope)
FIELDS = ["model", "budget", "budget_bytes", "peer", "compiled", "scope", "backend", "batch", "batch_source",
          "peak_bytes", "fits", "alloc_peak_bytes", "first_step_s", "second_step_s", "step_s", "samples_per_s", "compile_s", "regions",
          "graphs", "graph_breaks", "break_reasons", "auto_s", "finalists",
          "compile_speedup", "vs_fsdp2_compiled", "target", "target_met", "plan", "error", "device"]
# a tiny GPT for --dry-run (the smoke test): seconds, not minutes
DRY_MODEL = GPTConfig(vocab_size=128, seq_len=16, num_layers=2, hidden=32, heads=2)


def _break_reasons() -> dict[str, int]:
    """dynamo's graph-break reasons so far in this process, with their counts."""
    from torch._dynamo.utils import counters

    return {str(reason): int(n) for reason, n in counters["graph_break"].items()}


def _new_reasons(before: dict[str, int], after: dict[str, int], top: int = 3) -> str:
    """The ``top`` most frequent break reasons added between two ``_break_reasons``."""
    added = sorted(((n - before.get(r, 0), r) for r, n in after.items() if n > before.get(r, 0)), reverse=True)
    return " | ".join(f"{n}x {' '.join(r.split())[:200]}" for n, r in added[:top])


def _dynamo_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks) so far in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values()))


def _agreed_error(error: str) -> str:
    """The error of whichever rank had one ("" when none did): every rank drops a peer
    together (a peer that failed on one rank would hang the other's collectives)."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), "")


def _cold_compile_cache():
    """Inductor's caches, on disk and in memory, empty for one peer's compile (renamed
    from ``fresh_inductor_cache`` in torch 2.8)."""
    from torch._inductor import utils

    return (getattr(utils, "fresh_cache", None) or utils.fresh_inductor_cache)()


def _timed_step(model, optim, config, batch, seed) -> float:
    dist.barrier()
    start = time.perf_counter()
    train_step(model, optim, config, batch, seed=seed)
    return max_over_ranks(time.perf_counter() - start)


def _plan_label(plan) -> str:
    from collections import Counter

    labels = Counter(u.label for u in plan.units)
    ckpt = f", {len(plan.checkpoint_blocks)} ckpt blocks" if plan.checkpoint_blocks else ""
    return "; ".join(f"{n}x {label}" for label, n in labels.most_common()) + ckpt


def _finalists_label(plan) -> str:
    """What compiled auto mode measured ([Note: compiled plans]): each finalist's batch,
    compiled and eager samples/s, the kept one marked."""
    record = (plan.calibration.compiled or {}) if plan is not None else {}
    return "; ".join(f"{'kept ' if f['plan'] == record.get('kept') else ''}b{f['batch_size']} "
                     f"{f['samples_per_s']:.2f} compiled / {f['eager_samples_per_s']:.2f} eager"
                     + (f" (x{f['repeats']})" if f.get("repeats", 1) > 1 else "")
                     for f in record.get("finalists", []))


def _log(rank, start, what):
    if rank == 0:
        print(f"  [{time.perf_counter() - start:6.1f} s] {what}", flush=True)


def _run(rank, world, model_name, config, budget_bytes, steps, cache_dir, backend, auto_kwargs, osdp_scopes,
         compiled_plan):
    t0 = time.perf_counter()
    import osdp
    from osdp.models import GPT, example_batch
    from osdp.planner.cost_model import PlannerSettings

    compile_kwargs = dict(backend=backend, dynamic=False)
    if os.environ.get("OSDP_BENCH_INDUCTOR_OPTIONS"):  # --inductor-options, for both compiled peers
        compile_kwargs["options"] = json.loads(os.environ["OSDP_BENCH_INDUCTOR_OPTIONS"])
    outside = {}  # --outside-backend: OSDP's units outside the blocks
    if os.environ.get("OSDP_BENCH_OUTSIDE_BACKEND"):
        name = os.environ["OSDP_BENCH_OUTSIDE_BACKEND"]
        outside["outside_backend"] = None if name == "same" else name

    def osdp_compile(scope):
        return None if scope is None else {"scope": scope, **compile_kwargs, **outside}

    plans = {}  # scope (None: eager) -> (plan or None, error, seconds in auto mode)
    for label, peer, scope in PEERS:
        if peer != "osdp" or (scope and scope not in osdp_scopes):
            continue
        if scope and compiled_plan == "eager":  # --compiled-plan eager: the eager plan, compiled
            plans[scope] = plans[None]
            continue
        torch.manual_seed(0)
        start = time.perf_counter()
        try:  # auto mode at the budget, without checkpointing (bench/throughput.py's "osdp" peer)
            with _cold_compile_cache() if scope else contextlib.nullcontext():
                plan = osdp.auto_plan(GPT(config), example_batch(config, 4), budget_bytes, cache_dir=cache_dir,
                                      settings=PlannerSettings(max_slices=8, checkpointing="none"), progress=False,
                                      compile=osdp_compile(scope), **auto_kwargs)
            plans[scope] = (plan, "", max_over_ranks(time.perf_counter() - start))
        except osdp.InfeasiblePlanError as e:
            plans[scope] = (None, f"no plan fits: {e}"[:300], "")
        _log(rank, t0, f"auto plan for {label}: batch {plans[scope][0].batch_size if plans[scope][0] else '-'}")
    fsdp_batch, fsdp_peak = largest_fitting_batch("fsdp_zero3", config, budget_bytes)
    _log(rank, t0, f"FSDP2 batch {fsdp_batch}")
    rows, runs = [], []  # runs: (row, model, optim) timed together below
    for label, peer, scope in PEERS:
        if peer == "osdp" and scope and scope not in osdp_scopes:
            continue
        compiled = scope is not None
        plan, plan_error, auto_s = plans.get(scope, (None, "", "")) if peer == "osdp" else (None, "", "")
        row = dict(peer=label, compiled=compiled, scope=scope or "", backend=backend if compiled else "", error="",
                   plan=_plan_label(plan) if plan is not None else "", auto_s=auto_s,
                   finalists=_finalists_label(plan) if compiled else "")
        rows.append(row)
        if peer == "osdp":
            batch, source = (plan.batch_size, "the plan's") if plan else (0, "")
            row["error"] = plan_error
        else:
            batch, source = fsdp_batch, "largest fitting (eager tracker)"
            row["peak_bytes"] = "" if compiled else fsdp_peak
        if compiled and batch and peer != "osdp":
            source = "the eager peer's (not measured: see the docstring)"
        row.update(batch=batch, batch_source=source)
        if not batch:
            row["error"] = row["error"] or "batch 1 does not fit the budget"
            continue
        graphs, breaks = _dynamo_counts()
        reasons = _break_reasons()
        error = ""
        try:
            peer_compile = None if not compiled else osdp_compile(scope) if peer == "osdp" else compile_kwargs
            with _cold_compile_cache() if compiled else contextlib.nullcontext():
                model = wrap_peer(peer, config, plan=plan if peer == "osdp" else None, compile=peer_compile)
                optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
                dist.barrier()
                start = time.perf_counter()
                train_step(model, optim, config, batch, seed=1)
                first = time.perf_counter() - start
        except Exception as e:  # noqa: BLE001  (a compiler error is a result to report)
            error = f"{type(e).__name__}: {e}".replace("\n", " ")[:500]
            if rank == 0:
                traceback.print_exc()
        error = _agreed_error(error)
        if error:
            row["error"] = error
            continue
        row["first_step_s"] = max_over_ranks(first)
        row["second_step_s"] = _timed_step(model, optim, config, batch, seed=2)
        if peer == "osdp" and not compiled:  # FSDP2 eager's was read finding its batch
            row["peak_bytes"] = measured_peak_bytes(model, optim, config, batch, warm_up=False)
        row["alloc_peak_bytes"] = allocator_peak_bytes(model, optim, config, batch)
        after = _dynamo_counts()
        row.update(graphs=after[0] - graphs, graph_breaks=after[1] - breaks,
                   break_reasons=_new_reasons(reasons, _break_reasons()))
        if compiled:  # how many regions were compiled (OSDP: blocks + each unit outside them)
            row["regions"] = len(model.compiled_regions) if peer == "osdp" else len(model.blocks)
        runs.append((row, model, optim))
        _log(rank, t0, f"{label}: first step {row['first_step_s']:.2f} s, second {row['second_step_s']:.2f} s")
    before = _dynamo_counts()
    # every peer's steps interleaved: the ratios are taken in one run (a noisy machine)
    step_times = interleaved_step_s([(m, o, r["batch"]) for r, m, o in runs], config, steps)
    after = _dynamo_counts()
    _log(rank, t0, f"{steps} interleaved rounds")
    for (row, _, _), step_s in zip(runs, step_times):
        row.update(step_s=step_s, samples_per_s=row["batch"] * world / step_s,
                   compile_s=row["first_step_s"] - step_s)
    late = (after[0] - before[0], after[1] - before[1])
    return rows, late


def _summarize(rows: dict, name: str) -> list[str]:
    """Ratios and targets into the rows (each OSDP compiled peer, i.e. scope, judged on
    its own); the lines printed under the table."""
    timed = {k: r for k, r in rows.items() if r.get("step_s")}
    lines = []

    def gain(eager: str, comp: str) -> float | None:
        """Compiled samples/s over eager samples/s (each at its own batch)."""
        if eager in timed and comp in timed:
            rows[comp]["compile_speedup"] = timed[comp]["samples_per_s"] / timed[eager]["samples_per_s"]
            return rows[comp]["compile_speedup"]
        return None

    fsdp_gain = gain("fsdp2", "fsdp2_compiled")
    fc = rows.get("fsdp2_compiled", {})
    for label in (p for p in OSDP_COMPILED if p in rows):
        oc, scope = rows[label], rows[label].get("scope") or label
        osdp_gain = gain("osdp", label)
        if osdp_gain is not None and fsdp_gain is not None:
            met = osdp_gain >= fsdp_gain
            oc.update(target="compile gain >= FSDP2's", target_met=met)
            lines.append(f"compile gain (compiled / eager samples/s): OSDP ({scope}) {osdp_gain:.2f}x, FSDP2 "
                         f"{fsdp_gain:.2f}x  -> target OSDP >= FSDP2: {'MET' if met else 'NOT MET'}")
        else:
            lines.append(f"compile gain, OSDP ({scope}): not comparable (a peer has no timing: see error)")
        if label in timed and "fsdp2_compiled" in timed:
            ratio = oc["vs_fsdp2_compiled"] = oc["samples_per_s"] / fc["samples_per_s"]
            met = ratio >= 1.0
            oc["target"] = "; ".join(filter(None, [oc.get("target"), "samples/s >= 1.0x FSDP2 compiled"]))
            oc["target_met"] = oc.get("target_met", True) and met
            lines.append(f"OSDP compiled ({scope}) / FSDP2 compiled: {ratio:.2f}x samples/s (b={oc['batch']} vs "
                         f"b={fc['batch']})  -> target >= 1.0x: {'MET' if met else 'NOT MET'}")
        else:
            lines.append(f"OSDP compiled ({scope}) / FSDP2 compiled: not comparable (a peer has no timing: see error)")
    memory = [(label, rows[label]["alloc_peak_bytes"] / rows[eager]["alloc_peak_bytes"])
              for eager, label in [("osdp", p) for p in OSDP_COMPILED] + [("fsdp2", "fsdp2_compiled")]
              if rows.get(label, {}).get("alloc_peak_bytes") and rows.get(eager, {}).get("alloc_peak_bytes")]
    if memory:
        lines.append("allocator peak, compiled / eager: " + ", ".join(f"{label} {r:.3f}x" for label, r in memory))
    if "osdp" in timed and "fsdp2" in timed:
        lines.append(f"(for reference, eager: OSDP / FSDP2 "
                     f"{timed['osdp']['samples_per_s'] / timed['fsdp2']['samples_per_s']:.2f}x samples/s)")
    return [f"    {line}" for line in lines]


def _fmt(row, key, spec, scale=1.0):
    value = row.get(key)
    return "-" if value in (None, "") else format(value * scale if scale != 1.0 else value, spec)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one model (N&D), 3 timed rounds: a smoke run")
    parser.add_argument("--dry-run", action="store_true",
                        help="a tiny GPT, a short profile, 2 timed rounds (the test's run; --backend stays inductor "
                             "unless given)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--budget", choices=sorted(BUDGETS), default="middle",
                        help="memory budget, in fp32 parameter bytes (throughput.BUDGETS); one rank needs 'loose'")
    parser.add_argument("--steps", type=int, default=None, help="timed rounds (default 9; --quick 3)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of both compiled peers")
    parser.add_argument("--models", help=f"comma-separated subset of: {', '.join(MODELS)}")
    parser.add_argument("--inductor-options", help="JSON dict of inductor settings (torch.compile options=) for both "
                        "compiled peers, e.g. '{\"bucket_all_gathers_fx\": \"all\", \"bucket_all_reduces_fx\": \"all\"}'")
    parser.add_argument("--outside-backend", help="backend of OSDP's units outside the blocks "
                        "(CompileConfig.outside_backend, e.g. aot_eager; default and 'same': --backend)")
    parser.add_argument("--osdp-scopes", default="blocks,model",
                        help="OSDP's compile scopes to run (CompileConfig.scope), comma-separated: blocks, model")
    parser.add_argument("--compiled-plan", choices=("auto", "eager"), default="auto",
                        help="the plan OSDP's compiled peers run: compiled auto mode's (default) or the eager auto "
                        "plan (no compiled auto mode: shorter)")
    parser.add_argument("--cache-dir", default=str(ROOT / "bench" / "results" / ".profile-cache"))
    parser.add_argument("--out", help="CSV path (default bench/results/compile_<device>.csv)")
    args = parser.parse_args(argv)
    osdp_scopes = tuple(args.osdp_scopes.split(","))
    if any(scope not in SCOPES for scope in osdp_scopes):
        parser.error(f"--osdp-scopes {args.osdp_scopes!r}: a comma-separated subset of {', '.join(SCOPES)}")
    if args.outside_backend:
        os.environ["OSDP_BENCH_OUTSIDE_BACKEND"] = args.outside_backend
    if args.inductor_options:
        json.loads(args.inductor_options)  # refuse a malformed one here, not in the ranks
        os.environ["OSDP_BENCH_INDUCTOR_OPTIONS"] = args.inductor_options

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    models = {k: MODELS[k] for k in ("N&D 12x128", "W&S 2x768")}
    auto_kwargs = dict(comm_sizes=(4096, 65536, 1 << 20, 8 << 20), repeats=2)
    steps = args.steps or (3 if args.quick else 9)
    if args.quick:
        models = dict(list(models.items())[:1])
    if args.models:
        models = {k: MODELS[k] for k in args.models.split(",")}
    if args.dry_run:
        models = {"dry-run 2x32": DRY_MODEL}
        auto_kwargs = dict(comm_sizes=(4096,), repeats=1, calibrate=False)
        steps = args.steps or 2
    # a cold compile per run (the first step's time is reported as the compile time);
    # one compile worker per rank: the 2 ranks already use both cores
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="osdp-compile-bench-")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    start = time.perf_counter()
    table, lines = [], []
    for name, config in models.items():
        param_bytes = sum(p.numel() for p in GPT_params(config)) * 4
        budget = int(BUDGETS[args.budget] * param_bytes)
        rows, late = spawn(_run, args.world_size, name, config, budget, steps, args.cache_dir, args.backend,
                           auto_kwargs, osdp_scopes, args.compiled_plan)[0]
        by_peer = {r["peer"]: r for r in rows}
        summary = _summarize(by_peer, name)
        if any(late):
            summary.append(f"    dynamo during the timed steps: {late[0]} graphs compiled, {late[1]} graph breaks "
                           "(recompiles)")
        for r in rows:
            peak = r.get("peak_bytes")
            r.update(model=name, budget=args.budget, budget_bytes=budget, device=device,
                     fits="" if r["compiled"] or peak in (None, "") else bool(r["batch"]) and peak <= budget)
            table.append(r)
        lines.append((name, args.budget, budget, rows, summary))
        _print_model(name, args.budget, budget, rows, summary)
    elapsed = time.perf_counter() - start
    print(f"\n{'=' * 40} summary ({elapsed / 60:.1f} min, {steps} timed rounds, medians, {args.world_size} ranks on {device}, "
          f"backend {args.backend})")
    for name, budget_name, budget, rows, summary in lines:
        _print_model(name, budget_name, budget, rows, summary)
    osdp_batch = "its compiled auto plan's" if args.compiled_plan == "auto" else "the eager plan's (--compiled-plan eager)"
    print(f"FSDP2 compiled runs at its eager batch, OSDP compiled at {osdp_batch}; peak: live tensors (eager peers), "
          "alloc: the allocator's bytes (every peer); compile_s = first step - median steady step")
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / (
        f"compile_{device.replace(' ', '_')}{'_dry_run' if args.dry_run else '_quick' if args.quick else ''}.csv")
    write_csv(out, [{k: r.get(k, "") for k in FIELDS} for r in table])


def _print_model(name, budget_name, budget, rows, summary):
    print(f"\n{name}  {budget_name} budget {budget / 2**20:.1f} MiB")
    print(f"  {'peer':<19} {'batch':>5} {'peak MiB':>9} {'alloc MiB':>9} {'step ms':>8} {'samples/s':>9} {'1st step s':>10} "
          f"{'compile s':>9} {'regions':>7} {'graphs':>6} {'breaks':>6}  error")
    for r in rows:
        print(f"  {r['peer']:<19} {r['batch']:>5} {_fmt(r, 'peak_bytes', '9.1f', 2**-20):>9} "
              f"{_fmt(r, 'alloc_peak_bytes', '9.1f', 2**-20):>9} "
              f"{_fmt(r, 'step_s', '8.1f', 1e3):>8} {_fmt(r, 'samples_per_s', '9.2f'):>9} "
              f"{_fmt(r, 'first_step_s', '10.2f'):>10} "
              f"{_fmt(r, 'compile_s', '9.2f'):>9} {_fmt(r, 'regions', '7d'):>7} {_fmt(r, 'graphs', '6d'):>6} {_fmt(r, 'graph_breaks', '6d'):>6}  "
              f"{r.get('error', '')[:160]}")
    for r in rows:
        if r.get("break_reasons"):
            print(f"  {r['peer']} graph breaks: {r['break_reasons']}")
    for r in rows:
        if r.get("plan"):
            print(f"  {r['peer']} plan: {r['plan']} ({_fmt(r, 'auto_s', '.0f')} s in auto mode)"
                  + (f"; finalists: {r['finalists']}" if r.get("finalists") else ""))
    for line in summary:
        print(line)


if __name__ == "__main__":
    main()

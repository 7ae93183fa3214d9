"""Planner benchmark: search time against model size, C++ core vs Python reference, and
the time of one `osdp plan` command as a user runs it.

    python bench/planner.py                 # 12..192 layers at hidden 12288, full batch sweep, + the command
    python bench/planner.py --quick         # fewer sizes, fewer repeats
    python bench/planner.py --command       # the command only (median of --repeats runs)
    python bench/planner.py --command --baseline DIR   # and another checkout's, in turns (a baseline)

For GPT models of 12 to 192 layers at hidden 12288 (seq 2048, the GPT-3 shape) on the
8xH100 profile scaled to 256 ranks at 80 GiB (so that 192 layers fit), splitting up to 16 and per-block
checkpointing, it times the whole plan (template, feasibility probes, batch sweep) with
each search backend and prints medians and the C++/Python speed ratio.
The command (COMMAND below, issue 35's: every feature on, hpz, tied choices, layouts,
re-rank) runs as a fresh process, imports included: its wall time and the plan's own
search_s (the batch sweep), medians over the repeats; with --baseline, runs of the two
checkouts take turns (the load of a shared machine falls on both alike).
Every run appends its rows to bench/results/planner.csv (one per model size, one for the
command), with the commit and date, so the file keeps the history.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from osdp.models import GPTConfig  # noqa: E402
from osdp.planner.cluster import load_cluster  # noqa: E402
from osdp.planner.cost_model import PlannerSettings  # noqa: E402
from osdp.planner.gpt_desc import describe_gpt  # noqa: E402
from osdp.planner.run import RunSettings  # noqa: E402
from osdp.planner.batch_sweep import schedule  # noqa: E402


COMMAND = ("plan --layers 96 --hidden 12288 --heads 96 --seq 2048 --vocab 50304 --world-size 256 "
           "--cluster h100-nvlink --checkpointing auto --memory 80GiB --max-slices 16").split()
# the first seven are the sweep's of before; "run": what was timed ("schedule": the sweep in
# process, cpp_s and python_s its seconds; "osdp plan": COMMAND, cpp_s its plan's search_s)
FIELDS = ["layers", "ops", "batch", "searches", "cpp_s", "python_s", "ratio", "command_s", "run", "repeats", "commit",
          "date"]


def time_commands(roots: list[Path], repeats: int) -> list[dict]:
    """COMMAND run ``repeats`` times from each checkout in ``roots`` (its code, its
    imports), the checkouts taking turns so that a shared machine's load falls on each
    alike: per checkout, medians of the wall time and of the plan's search_s."""
    walls, searches, plans = ([[] for _ in roots] for _ in range(3))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        for _ in range(repeats):
            for k, root in enumerate(roots):
                start = time.perf_counter()
                subprocess.run([sys.executable, "-m", "osdp.cli", *COMMAND, "--json", str(out)], cwd=root,
                               env=dict(os.environ, PYTHONPATH=str(root)), check=True, stdout=subprocess.DEVNULL)
                walls[k].append(time.perf_counter() - start)
                plans[k] = json.loads(out.read_text())
                searches[k].append(plans[k]["search_s"])
    layers = int(COMMAND[COMMAND.index("--layers") + 1])
    return [dict(layers=layers, ops=len(plan["units"]), batch=plan["batch_size"], searches=plan["searches"],
                 cpp_s=statistics.median(search), command_s=statistics.median(wall), run="osdp plan",
                 repeats=repeats, commit=_commit(root))
            for root, plan, search, wall in zip(roots, plans, searches, walls)]


def _commit(root: Path) -> str:
    """The checkout's short commit (+ if its tracked files differ), or its folder name."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "diff", "--quiet", "HEAD", "--", ".",
                                ":(exclude)bench/results"]).returncode != 0
        return head + ("+" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return root.name


def append_rows(path: Path, rows: list[dict]) -> None:
    """Append ``rows`` to the CSV at ``path``, keeping the rows already there (their
    columns are a prefix of FIELDS: older rows leave the newer columns empty)."""
    old = list(csv.DictReader(path.open())) if path.exists() else []
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(old + rows)


def time_plan(desc, device, settings, backend, repeats):
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = schedule(desc, device, settings, backend=backend)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--hidden", type=int, default=12288)
    parser.add_argument("--world-size", type=int, default=256)
    parser.add_argument("--memory-gib", type=float, default=80)
    parser.add_argument("--python-max-layers", type=int, default=96, help="skip the slow reference above this")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "planner.csv"))
    parser.add_argument("--command", action="store_true", help="time only the `osdp plan` command (COMMAND)")
    parser.add_argument("--baseline", help="another checkout whose command is timed too, in turns (a row of its own)")
    parser.add_argument("--repeats", type=int, help="runs per measurement (default 3, --quick 1; command: 5)")
    args = parser.parse_args(argv)
    date = datetime.date.today().isoformat()

    roots = ([Path(args.baseline).resolve()] if args.baseline else []) + [ROOT]
    if args.command:
        rows = [dict(row, date=date) for row in time_commands(roots, args.repeats or 5)]
        print(f"osdp {' '.join(COMMAND)}")
        for row in rows:
            print(f"  {row['commit']}: search_s {row['cpp_s']:.3f} s, command {row['command_s']:.2f} s "
                  f"(medians of {row['repeats']}); batch {row['batch']}, {row['searches']} searches")
        append_rows(Path(args.out), rows)
        print(f"appended to {args.out}")
        return

    layers = [12, 48, 96] if args.quick else [12, 24, 48, 96, 144, 192]
    repeats = args.repeats or (1 if args.quick else 3)
    run = RunSettings(world_size=args.world_size, memory_limit_bytes=args.memory_gib * 2**30)
    device = load_cluster("h100-nvlink").for_run(run)  # one link level: see [Note: link levels]
    settings = PlannerSettings(max_slices=16, checkpointing="auto")
    rows = []
    print(f"hidden {args.hidden}, seq 2048, {device.name} scaled to {args.world_size} ranks at {args.memory_gib:g} GiB, "
          f"max 16 slices, per-block checkpointing, full batch sweep; median of {repeats}")
    print(f"{'layers':>6} {'ops':>5} {'batch':>5} {'searches':>8} {'cpp s':>8} {'python s':>9} {'py/cpp':>7}")
    for n in layers:
        desc = describe_gpt(GPTConfig(vocab_size=50257, seq_len=2048, num_layers=n, hidden=args.hidden, heads=96))
        cpp_s, res = time_plan(desc, device, settings, "cpp", repeats)
        py_s = None
        if n <= args.python_max_layers:
            py_s, py_res = time_plan(desc, device, settings, "python", 1)
            assert py_res.batch == res.batch and py_res.result.time_s == res.result.time_s, "backends disagree"
        ratio = f"{py_s / cpp_s:7.1f}" if py_s else "      -"
        print(f"{n:>6} {len(desc.ops):>5} {res.batch:>5} {res.searches:>8} {cpp_s:>8.3f} "
              f"{(f'{py_s:9.3f}' if py_s else '        -')} {ratio}")
        rows.append(dict(layers=n, ops=len(desc.ops), batch=res.batch, searches=res.searches,
                         cpp_s=cpp_s, python_s=py_s if py_s else "", ratio=py_s / cpp_s if py_s else "",
                         run="schedule", repeats=repeats, commit=_commit(ROOT), date=date))
    commands = [dict(row, date=date) for row in time_commands(roots, args.repeats or (3 if args.quick else 5))]
    for row in commands:
        print(f"osdp {' '.join(COMMAND)} ({row['commit']}): search_s {row['cpp_s']:.3f} s, command "
              f"{row['command_s']:.2f} s (medians of {row['repeats']})")
    append_rows(Path(args.out), rows + commands)
    print(f"appended to {args.out}")


if __name__ == "__main__":
    main()

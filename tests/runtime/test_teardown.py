"""Leaving a gloo process cleanly ([Note: exiting a gloo process] in osdp/launch.py).

A process that used gloo can abort after its last line (``terminate called without an
active exception``, SIGABRT) while the interpreter finalizes. ``osdp.launch.spawn``'s
workers and ``osdp.launch.finish`` leave with ``os._exit`` after a barrier and
``destroy_process_group``, so finalization (and the race) never happens.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import osdp
from runtime.dist_harness import free_port, spawn

SCRIPT = Path(__file__).with_name("teardown_script.py")
REPO = Path(osdp.__file__).resolve().parent.parent  # the osdp this test imported
RUNS = 20


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _atexit_marker_rank(rank, world, marker_dir):
    import atexit

    def mark():
        Path(marker_dir, f"{rank}").write_text("atexit ran")

    atexit.register(mark)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return t.item()


def test_spawned_workers_leave_without_interpreter_finalization(tmp_path):
    """The race lives in interpreter finalization; spawn's workers skip it (os._exit after
    writing their result), which an atexit handler that never runs shows."""
    # fresh: this is about osdp.launch.spawn's own processes (a pool's worker lives on)
    assert spawn(_atexit_marker_rank, 2, str(tmp_path), fresh=True) == [3.0, 3.0]
    assert list(tmp_path.iterdir()) == [], "a spawned worker finalized its interpreter (atexit ran)"


def test_spawned_worker_errors_still_come_back(tmp_path):
    with pytest.raises(RuntimeError, match="(?s)rank 1:.*ZeroDivisionError"):
        spawn(_failing_rank, 2, fresh=True)  # osdp.launch.spawn's error path


def _failing_rank(rank, world):
    if rank == 1:
        return 1 / 0
    return rank


def _run(mode, **env):
    return subprocess.run([sys.executable, str(SCRIPT), mode], env=_env(**env), capture_output=True, text=True,
                          timeout=120)


def test_finish_flushes_skips_atexit_and_exits_with_the_code(tmp_path):
    marker = tmp_path / "marker"
    done = _run("exit3", ATEXIT_MARKER=marker, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    assert done.returncode == 3, done.stderr
    assert done.stdout == "unflushed line\n"
    assert not marker.exists(), "finish must leave with os._exit (no atexit, no finalization)"
    done = _run("no_group", ATEXIT_MARKER=marker)
    assert (done.returncode, done.stdout) == (0, "no process group\n"), done.stderr
    done = _run("raises")
    assert done.returncode == 1 and "ValueError: broken on purpose" in done.stderr
    assert _run("returns").returncode == 4


@pytest.mark.slow
def test_torchrun_style_script_exits_0_every_time():
    """20 runs of a 2-rank gloo training script started as torchrun starts its workers
    (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the environment), ending in
    osdp.launch.finish(): every process must exit 0. Without finish (ending with
    destroy_process_group only) about 1 run in 15-30 aborts here. ~3 s per run."""
    failures, started = [], time.perf_counter()
    for run in range(RUNS):
        port = free_port()
        procs = [
            subprocess.Popen(
                [sys.executable, str(SCRIPT), "train"],
                env=_env(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=2, LOCAL_WORLD_SIZE=2, MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=port),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            for rank in range(2)
        ]
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=180)
            if proc.returncode != 0 or f"rank {rank}/2 done" not in out:
                failures.append(f"run {run} rank {rank}: exit code {proc.returncode}\n{out}{err[-2000:]}")
    elapsed = time.perf_counter() - started
    assert not failures, f"{len(failures)} of {2 * RUNS} processes failed ({elapsed:.0f} s):\n" + "\n".join(failures)

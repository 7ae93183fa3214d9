"""Persistent gloo ranks for the tests: one pool of ``world`` worker processes per world
size, started on first use and kept for the whole test session, that run the functions
sent to them, ``fn(rank, world, *args)``, as ``osdp.launch.spawn`` would, without paying
process start, ``import torch`` and ``import osdp`` again for every test module.

[Note: test rank pool]
Why per session, not per module: the start is the cost (seconds per rank on a 2-core
machine, every rank importing torch at once) and the multi-process modules are many;
per module would pay it about as often as spawning. What a module could leak to the
next is handled per task instead:

- every task runs with the test process's environment variables and working directory of
  the moment it is sent (what a process spawned then would inherit), and a fresh default
  process group (``init_process_group`` on a new rendezvous file
  before ``fn``, a barrier and ``destroy_process_group`` after it: subgroups, device
  meshes' groups and group counters go with it), as a fresh spawn would;
- after a task that succeeded on every rank, the process-wide state a test can change
  is put back: environment variables, the working directory, ``sys.path``, warning
  filters (and their once-registries), torch's default dtype and device, thread count,
  matmul precision, deterministic and anomaly modes, grad mode; the RNGs (torch,
  ``random``, numpy) are reseeded at random, as a fresh process starts;
- after a task that failed on any rank (an exception, a dead process, or no answer
  within the timeout), the pool is not trusted again: every worker is killed and the
  next task starts a new pool. A rank that raises while its peers wait in a collective
  is the usual case: its traceback comes back at once, the peers are killed after a
  short grace, and the error says which ranks did not finish. A task that runs past
  ``timeout_s`` (``OSDP_TEST_POOL_TIMEOUT_S``, 300 s by default; the longest task,
  the 4-rank checkpoint run, takes about 20 s on 2 loaded cores) comes back as an
  error with every unfinished rank's Python stacks (faulthandler, SIGUSR1).

A rank's exception comes back as a RuntimeError carrying that rank's traceback
(``rank N:\\n<traceback>``), results in rank order, like ``osdp.launch.spawn``. A rank's
stdout and stderr during a task are copied to the test's stderr (pytest captures it).

What is not put back: modules stay imported (a later task sees them loaded, and any
module-level state they keep, such as osdp's one-time clip guard on torch's total-norm
helper, stays as the first task left it), and the allocator keeps what it grew to.

Tests that need a process of their own (they set environment variables read at import,
test process exit, a crash or a timeout, or start their own process group) use
``dist_harness.spawn(..., fresh=True)`` or their own processes.

Workers leave with ``osdp.launch.finish`` (``os._exit``): see [Note: exiting a gloo
process] in osdp/launch.py. ``shutdown()`` runs at the end of the session
(``tests/conftest.py``) and at interpreter exit; a worker whose parent is gone exits too.
"""
from __future__ import annotations

import faulthandler
import os
import pickle
import random
import signal
import sys
import tempfile
import time
import traceback
import warnings
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


__all__ = ["RankPool", "run", "shutdown"]

TIMEOUT_S = float(os.environ.get("OSDP_TEST_POOL_TIMEOUT_S", "300"))
GRACE_S = 3.0  # after one rank failed: how long the others may take to report theirs
_START_TIMEOUT_S = 300.0


# ---- worker side ----------------------------------------------------------------------
def _process_state() -> dict:
    return {
        "environ": dict(os.environ),
        "cwd": os.getcwd(),
        "sys_path": list(sys.path),
        "warning_filters": list(warnings.filters),
        "dtype": torch.get_default_dtype(),
        "device": torch.get_default_device(),
        "threads": torch.get_num_threads(),
        "matmul": torch.get_float32_matmul_precision(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "anomaly": torch.is_anomaly_enabled(),
    }


def _restore(state: dict) -> None:
    os.environ.clear()
    os.environ.update(state["environ"])
    os.chdir(state["cwd"])
    sys.path[:] = state["sys_path"]
    warnings.filters[:] = state["warning_filters"]
    warnings._filters_mutated()  # forget what was already warned "once"
    torch.set_default_dtype(state["dtype"])
    torch.set_default_device(None if state["device"] == torch.device("cpu") else state["device"])
    torch.set_num_threads(state["threads"])
    torch.set_float32_matmul_precision(state["matmul"])
    torch.use_deterministic_algorithms(state["deterministic"])
    torch.autograd.set_detect_anomaly(state["anomaly"])
    torch.set_grad_enabled(True)


def _reseed() -> None:
    """Random seeds, as a fresh process has."""
    torch.seed()
    random.seed()
    try:
        import numpy

        numpy.random.seed()
    except ImportError:
        pass


class _Redirect:
    """fds 1 and 2 to ``path`` while a task runs (to os.devnull between tasks)."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self):
        _flush_std()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)

    def __exit__(self, *exc):
        _flush_std()
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _worker(rank: int, world: int, conn) -> None:
    from osdp.launch import _barrier, finish

    _Redirect(os.devnull).__exit__()  # nothing goes to the fds it was started with (an old test's capture)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)  # fd 2: the task's log
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # as osdp.launch.spawn
    state = _process_state()
    conn.send("ready")
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            break
        if task is None:
            break
        store_path, environ, cwd, payload, out_path, log_path = task
        ok = False
        with _Redirect(log_path):
            try:
                _reseed()
                os.environ.clear()
                os.environ.update(environ)  # the test process's, as a spawned process inherits it
                os.environ["MASTER_ADDR"] = "127.0.0.1"
                os.chdir(cwd)
                fn, args = pickle.loads(payload)
                # a file rendezvous: a port chosen here and bound later by rank 0 could be
                # taken in between by another test's process (EADDRINUSE, seen under xdist)
                dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
                result = fn(rank, world, *args)
                torch.save({"ok": True, "result": result}, out_path)
                del result
                _barrier(TIMEOUT_S)  # no peer still reading from this rank
                dist.destroy_process_group()
                _restore(state)
                ok = True
            except BaseException:
                if not os.path.exists(out_path):
                    torch.save({"ok": False, "error": traceback.format_exc()}, out_path)
                else:  # the result was written; the cleanup after it failed
                    torch.save({"ok": False, "error": "after the function returned:\n" + traceback.format_exc()},
                               out_path)
        import gc

        gc.collect()
        try:
            conn.send(ok)
        except (BrokenPipeError, OSError):
            break
        if not ok:  # the parent kills this pool; do not wait for it in a broken state
            break
    finish(0 if not dist.is_initialized() else 1)  # see [Note: exiting a gloo process]


# ---- parent side ----------------------------------------------------------------------
class RankPool:
    """``world`` persistent gloo ranks; ``run(fn, *args)`` is ``spawn(fn, world, *args)``."""

    def __init__(self, world: int):
        self.world = world
        self.procs: list = []
        self.conns: list = []
        self.tmp = None
        self.tasks = 0

    # lifecycle
    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.tmp = tempfile.TemporaryDirectory(prefix=f"osdp-pool{self.world}-")
        for rank in range(self.world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, self.world, child), daemon=True,
                               name=f"osdp-test-rank{rank}of{self.world}")
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        deadline = time.monotonic() + _START_TIMEOUT_S
        for rank, conn in enumerate(self.conns):
            left = deadline - time.monotonic()
            if not conn.poll(max(0.0, left)):
                self.close(kill=True)
                raise RuntimeError(f"rank pool of {self.world}: rank {rank} did not start within {_START_TIMEOUT_S} s")
            try:
                conn.recv()
            except EOFError:
                code = self.procs[rank].exitcode
                self.close(kill=True)
                raise RuntimeError(f"rank pool of {self.world}: rank {rank} died while starting (exit code {code})")

    @property
    def alive(self) -> bool:
        return bool(self.procs)

    def close(self, kill: bool = False) -> None:
        """Stop the workers: ask them to exit, or (``kill``) SIGKILL them."""
        if not kill:
            for conn in self.conns:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
            for proc in self.procs:
                proc.join(10)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(10)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
        if self.tmp is not None:
            self.tmp.cleanup()
            self.tmp = None

    # tasks
    def run(self, fn, *args, timeout_s: float | None = None) -> list:
        timeout_s = TIMEOUT_S if timeout_s is None else timeout_s
        payload = pickle.dumps((fn, args))  # fails here, in the test, if fn is not importable
        if not self.alive:
            self._start()
        self.tasks += 1
        task_dir = os.path.join(self.tmp.name, str(self.tasks))
        os.makedirs(task_dir)
        out = [os.path.join(task_dir, f"{r}.pt") for r in range(self.world)]
        logs = [os.path.join(task_dir, f"{r}.log") for r in range(self.world)]
        store = os.path.join(task_dir, "rendezvous")
        try:
            return self._run(fn, out, logs, store, payload, timeout_s)
        except BaseException:  # an error of its ranks closed it already; an interrupt here: kill it
            if self.alive:
                self.close(kill=True)
            raise

    def _run(self, fn, out, logs, store, payload, timeout_s) -> list:
        for rank, conn in enumerate(self.conns):
            conn.send((store, dict(os.environ), os.getcwd(), payload, out[rank], logs[rank]))

        done: dict[int, bool] = {}  # rank -> ok
        dead: dict[int, int | None] = {}  # rank -> exit code
        deadline = time.monotonic() + timeout_s
        failed_at = None
        while len(done) + len(dead) < self.world:
            now = time.monotonic()
            if failed_at is not None and now > failed_at + GRACE_S:
                break
            if now > deadline:
                break
            limit = min(deadline, failed_at + GRACE_S if failed_at is not None else deadline) - now
            waiting = {r for r in range(self.world) if r not in done and r not in dead}
            objects = {}
            for r in waiting:
                objects[self.conns[r]] = ("conn", r)
                objects[self.procs[r].sentinel] = ("proc", r)
            for obj in wait(list(objects), timeout=max(0.0, limit)):
                kind, r = objects[obj]
                if r in done or r in dead:
                    continue
                if kind == "conn":
                    try:
                        done[r] = self.conns[r].recv()
                    except (EOFError, OSError):
                        self.procs[r].join(1)
                        dead[r] = self.procs[r].exitcode
                else:
                    if self.conns[r].poll():  # answered, then exited (a failed rank leaves)
                        try:
                            done[r] = self.conns[r].recv()
                            continue
                        except (EOFError, OSError):
                            pass
                    self.procs[r].join(1)
                    dead[r] = self.procs[r].exitcode
                if (r in dead or not done.get(r, True)) and failed_at is None:
                    failed_at = time.monotonic()

        if len(done) == self.world and all(done.values()):
            self._copy_logs(logs)
            return [torch.load(p, weights_only=False)["result"] for p in out]

        # a failure: collect what there is, then replace the pool
        timed_out = failed_at is None
        unfinished = [r for r in range(self.world) if r not in done and r not in dead]
        if unfinished:
            for r in unfinished:  # their stacks, into their logs
                try:
                    os.kill(self.procs[r].pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
            time.sleep(1.0)
        errors = []
        for rank in range(self.world):
            if os.path.exists(out[rank]):
                try:
                    data = torch.load(out[rank], weights_only=False)
                except Exception as exc:  # killed while writing it
                    data = {"ok": False, "error": f"its result file is unreadable ({exc!r})"}
                if not data["ok"]:
                    errors.append(f"rank {rank}:\n{data['error']}")
        for rank, code in sorted(dead.items()):
            if not os.path.exists(out[rank]):
                errors.append(f"rank {rank}: the process died (exit code {code})\n{_tail(logs[rank])}")
        if unfinished:
            why = f"did not finish within {timeout_s:.0f} s" if timed_out else \
                f"did not finish within {GRACE_S:.0f} s of the first failure"
            errors.append(f"rank pool of {self.world} ({_name(fn)}): ranks {unfinished} {why}; "
                          "the pool was killed and restarts for the next test")
            for r in unfinished:
                errors.append(f"rank {r} output and stacks:\n{_tail(logs[r])}")
        self._copy_logs(logs)
        self.close(kill=True)  # after reading its files: they go with it
        raise RuntimeError("\n".join(errors))

    def _copy_logs(self, logs: list) -> None:
        for rank, path in enumerate(logs):
            text = _tail(path, limit=None)
            if text:
                sys.stderr.write(f"---- rank {rank} of {self.world} ----\n{text}")
                if not text.endswith("\n"):
                    sys.stderr.write("\n")


def _tail(path: str, limit: int | None = 20000) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    return text if limit is None or len(text) <= limit else "...\n" + text[-limit:]


def _name(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"


# ---- the session's pools --------------------------------------------------------------
_POOLS: dict[int, RankPool] = {}


def run(fn, world: int, *args, timeout_s: float | None = None) -> list:
    """``fn(rank, world, *args)`` on the session's pool of ``world`` ranks."""
    pool = _POOLS.get(world)
    if pool is None:
        pool = _POOLS[world] = RankPool(world)
    return pool.run(fn, *args, timeout_s=timeout_s)


def shutdown() -> None:
    """Stop every pool (the end of the session)."""
    for pool in list(_POOLS.values()):
        pool.close()
    _POOLS.clear()


import atexit  # noqa: E402

atexit.register(shutdown)

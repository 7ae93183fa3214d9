"""Run a function on N local ranks (spawned processes) and collect what each returns;
leave a distributed process cleanly (``finish``).

Used by ``osdp demo``, the benchmarks and the multi-process tests: gloo on CPU, NCCL on
GPU (one device per rank, round robin). A rank's exception comes back as a RuntimeError
carrying that rank's traceback; every rank's result comes back in rank order.

Scripts started by ``torchrun`` end with :func:`finish` (or run their main function
through :func:`run_main`)::

    dist.init_process_group("gloo")
    ...train...
    osdp.launch.finish()          # barrier, destroy_process_group, flush, os._exit(0)

[Note: exiting a gloo process]
A process that used a gloo process group can die with ``terminate called without an
active exception`` (SIGABRT, exit code -6) after its last line, about one run in ten
to four, with or without ``destroy_process_group``: a gloo worker thread still holds
the last reference to a tensor (or its own ``std::thread``) while the interpreter
finalizes and runs static destructors (FSDP2 alone shows it too). Nothing in the
process is wrong at that point, but the exit code is. So a process leaves without
finalizing: wait for every rank (a barrier, so that no peer is still reading from this
one), destroy the process group, flush stdout/stderr and the logging handlers, then
``os._exit``: no ``atexit`` handlers, no static destructors, no race. The spawned
workers of :func:`spawn` do the same after writing their result file. Consequences for
a script: close (or flush) its own files before ``finish``; ``atexit`` handlers do not
run.
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
import tempfile
import traceback
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, out_dir, backend, fn, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    code = 1
    try:
        # a file rendezvous in the run's own directory: a free port chosen by the parent
        # and bound later by rank 0 can be taken in between by another process
        # (EADDRINUSE, seen with tests running side by side)
        init = f"file://{os.path.join(out_dir, 'rendezvous')}"
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
        result = fn(rank, world, *args)
        torch.save({"ok": True, "result": result}, os.path.join(out_dir, f"{rank}.pt"))
        code = 0
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, os.path.join(out_dir, f"{rank}.pt"))
    finish(code)  # see [Note: exiting a gloo process]


def spawn(fn, world: int, *args, backend: str | None = None) -> list:
    """``fn(rank, world, *args)`` on ``world`` local ranks; the per-rank results.
    ``fn`` must be importable (a module-level function)."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.spawn(_worker, args=(world, out_dir, backend, fn, args), nprocs=world)
        except Exception as exc:
            errors = []
            for rank in range(world):
                path = os.path.join(out_dir, f"{rank}.pt")
                if os.path.exists(path):
                    data = torch.load(path, weights_only=False)
                    if not data["ok"]:
                        errors.append(f"rank {rank}:\n{data['error']}")
            raise RuntimeError("\n".join(errors) or str(exc)) from exc
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False)["result"] for r in range(world)]


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing left to flush there
            pass
    try:
        logging.shutdown()
    except Exception:
        pass


def _barrier(timeout_s: float) -> None:
    if dist.get_backend() == "gloo":  # says which rank did not arrive, within the timeout
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
    else:
        dist.barrier()


def finish(exit_code: int = 0, *, timeout_s: float = 300.0) -> NoReturn:
    """End this process now, cleanly: see [Note: exiting a gloo process].

    With a process group initialized: a barrier (only when ``exit_code`` is 0: a
    failing rank must not wait for peers that may never arrive; ``timeout_s`` bounds it
    on gloo), then ``destroy_process_group``. Then stdout, stderr and the logging
    handlers are flushed and the process exits with ``os._exit(exit_code)``; it never
    returns and never aborts. If the teardown itself fails (a peer gone), the reason
    goes to stderr and the exit code is 1 unless it was already non-zero. Close your
    own files first: ``atexit`` handlers do not run.
    """
    code = int(exit_code)
    try:
        if dist.is_available() and dist.is_initialized():
            if code == 0:
                _barrier(timeout_s)
            dist.destroy_process_group()
    except Exception as exc:  # the exit must still happen, and say why it is not clean
        sys.stderr.write(f"osdp.launch.finish: process-group teardown failed ({type(exc).__name__}: {exc}); "
                         "exiting anyway\n")
        code = code or 1
    _flush()
    os._exit(code)


def run_main(main, *args, **kwargs) -> NoReturn:
    """``main(*args, **kwargs)``, then :func:`finish`: exit code 0 when it returns None
    (or its int return value), 1 with the traceback on stderr when it raises, the code
    of a ``SystemExit``. For the ``if __name__ == "__main__":`` line of torchrun scripts."""
    try:
        code = main(*args, **kwargs)
        code = 0 if code is None else int(code)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            sys.stderr.write(f"{exc.code}\n")
    except BaseException:
        traceback.print_exc()
        code = 1
    finish(code)

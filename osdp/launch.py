"""Run a function on N local ranks (spawned processes) and collect what each returns.

Used by ``osdp demo``, the benchmarks and the multi-process tests: gloo on CPU, NCCL on
GPU (one device per rank, round robin). A rank's exception comes back as a RuntimeError
carrying that rank's traceback; every rank's result comes back in rank order.
"""
from __future__ import annotations

import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, out_dir, backend, fn, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save({"ok": True, "result": result}, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, os.path.join(out_dir, f"{rank}.pt"))
        raise
    finally:
        dist.destroy_process_group()


def spawn(fn, world: int, *args, backend: str | None = None) -> list:
    """``fn(rank, world, *args)`` on ``world`` local ranks; the per-rank results.
    ``fn`` must be importable (a module-level function)."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.spawn(_worker, args=(world, free_port(), out_dir, backend, fn, args), nprocs=world)
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

"""Run a function on N gloo ranks (spawned processes) and collect what each returns.

Process start and ``import torch`` cost seconds, so tests run many configurations
inside one spawn and assert on the collected results afterwards.
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


def _worker(rank, world_size, port, out_dir, fn, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, os.path.join(out_dir, f"{rank}.pt"))
        raise
    finally:
        dist.destroy_process_group()


def spawn(fn, world_size: int, *args) -> list:
    """``fn(rank, world_size, *args)`` on every rank; returns the per-rank results."""
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.spawn(_worker, args=(world_size, free_port(), out_dir, fn, args), nprocs=world_size)
        except Exception as exc:
            errors = []
            for rank in range(world_size):
                path = os.path.join(out_dir, f"{rank}.pt")
                if os.path.exists(path):
                    data = torch.load(path, weights_only=False)
                    if not data["ok"]:
                        errors.append(f"rank {rank}:\n{data['error']}")
            raise RuntimeError("\n".join(errors) or str(exc)) from exc
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False)["result"] for r in range(world_size)]

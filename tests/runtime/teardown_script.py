"""A torchrun-style training script for tests/runtime/test_teardown.py.

``python teardown_script.py train``: under torchrun (or with RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT set): a few OSDP steps of a tiny GPT on gloo, then
``osdp.launch.finish()``. Other modes check ``finish`` / ``run_main`` in one process.
"""
import atexit
import os
import sys

import torch
import torch.distributed as dist

from osdp.launch import finish, run_main


def _marker():
    path = os.environ.get("ATEXIT_MARKER")
    if path:
        with open(path, "w") as f:
            f.write("atexit ran")


def train():
    import osdp
    from osdp.models import GPT, GPTConfig, example_batch

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=97, seq_len=8, num_layers=2, hidden=16, heads=2)
    model = osdp.OSDP(GPT(config), modes={"blocks.0.mlp.c_fc": "dp"}, default_mode="zdp")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        idx, targets = example_batch(config, 2, seed=10 * step + rank)
        loss = model(idx, targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
    print(f"rank {rank}/{world} done, loss {loss.item():.4f}")  # no flush: finish flushes


def main(mode):
    atexit.register(_marker)
    if mode == "train":
        train()
        finish()
    if mode == "exit3":  # a 1-rank group, an unflushed line, a non-zero code
        dist.init_process_group("gloo", rank=0, world_size=1)
        print("unflushed line")
        finish(3)
    if mode == "no_group":
        print("no process group")
        finish()
    if mode == "raises":
        def broken():
            raise ValueError("broken on purpose")
        run_main(broken)
    if mode == "returns":
        run_main(lambda: 4)
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1])

"""Per-rank body of ``test_same_values.py``: ranks that wrap different values."""
from __future__ import annotations

import torch

import osdp
from osdp.errors import PlanMismatchError
from osdp.models import GPT, GPTConfig, example_batch

CONFIG = GPTConfig(vocab_size=97, seq_len=8, num_layers=2, hidden=10, heads=2)


def _error(build) -> str | None:
    try:
        build()
    except PlanMismatchError as exc:
        return str(exc)
    return None


def run(rank: int, world: int) -> dict:
    out = {}
    torch.manual_seed(0)
    same = GPT(CONFIG)
    pretrained = {k: v.clone() for k, v in same.state_dict().items()}
    out["same"] = _error(lambda: osdp.OSDP(same, default_mode="zdp"))
    torch.manual_seed(rank)  # forgot to seed alike
    model = GPT(CONFIG)
    out["rep"] = _error(lambda: osdp.OSDP(model, default_mode="rep"))
    with torch.no_grad():  # pretrained weights loaded on rank 0 only: one tensor apart
        same_but_head = GPT(CONFIG)
        same_but_head.load_state_dict(pretrained)
        same_but_head.lm_head.weight.add_(rank)
    out["one_tensor"] = _error(lambda: osdp.OSDP(same_but_head, default_mode="zdp"))
    # nothing changed: the same model wraps with rank 0's values broadcast, and trains
    synced = osdp.OSDP(model, default_mode="rep", sync_module_states=True)
    idx, tgt = example_batch(CONFIG, 2, seed=rank)
    synced(idx, tgt).backward()
    out["synced_state"] = synced.full_state_dict(rank0_only=False)
    torch.manual_seed(rank)
    with torch.device("meta"):
        meta = GPT(CONFIG)
    out["meta"] = _error(lambda: osdp.OSDP(meta, default_mode="zdp"))
    return out

"""rank_agreement.collective_device: where a small tensor must live for a collective."""
from __future__ import annotations

import torch
import torch.distributed as dist

from osdp import rank_agreement


def test_without_a_process_group_the_cpu():
    assert not dist.is_initialized()
    assert rank_agreement.collective_device() == torch.device("cpu")


def _fake_group(monkeypatch, backend: str, cuda: bool):
    monkeypatch.setattr(rank_agreement, "_distributed", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)


def test_nccl_needs_the_current_gpu(monkeypatch):
    _fake_group(monkeypatch, "nccl", cuda=True)
    assert rank_agreement.collective_device() == torch.device("cuda", 3)


def test_gloo_and_a_gloo_nccl_pair_take_cpu_tensors(monkeypatch):
    for backend in ("gloo", "cpu:gloo,cuda:nccl"):
        _fake_group(monkeypatch, backend, cuda=True)
        assert rank_agreement.collective_device() == torch.device("cpu"), backend

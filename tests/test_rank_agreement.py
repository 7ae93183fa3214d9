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


def test_max_over_ranks_without_a_process_group_is_the_value():
    assert rank_agreement.max_over_ranks(1.5) == 1.5
    assert rank_agreement.max_over_ranks([1.0, 2.0]) == [1.0, 2.0]


def _max_on_ranks(rank: int, world: int) -> tuple:
    return (rank_agreement.max_over_ranks(float(rank) + 0.25),
            rank_agreement.max_over_ranks([float(rank), 10.0 - rank, 2 ** 40 + rank]))


def test_max_over_ranks_on_two_gloo_ranks():
    """Elementwise, float64 (a peak of 2**40 + 1 bytes stays exact), the same on every rank."""
    from runtime.dist_harness import spawn

    assert spawn(_max_on_ranks, 2) == [(1.25, [1.0, 10.0, 2.0 ** 40 + 1])] * 2

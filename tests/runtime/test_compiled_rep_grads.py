"""The compiled path's ``rep`` gradients ([Note: rep gradients bucketed] in
osdp/runtime/compiled_rep_grads.py) on 2 gloo ranks: all-reduced in eager OSDP's
buckets (the same collectives on both ranks, none over a bucket's worth beyond one
parameter, at most one in flight), going out while backward still runs where a graph
ends before it (``scope="blocks"``), and giving the gradients of single-process
training on the whole batch."""
from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import osdp
from osdp.contract import REPLICATE_BUCKET_BYTES
from osdp.models.gpt import GPT, GPTConfig, example_batch
from runtime.dist_harness import spawn

# 3 layers of hidden 384: 7.1 MB of fp32 weights a layer, more than a 4 MiB bucket, so
# the last block's gradients fill one before block 0's backward runs
CONFIG = GPTConfig(vocab_size=128, seq_len=8, num_layers=3, hidden=384, heads=4)
LOCAL_BATCH = 2


class _Recorder:
    """Wraps ``c10d.all_reduce``: each collective's bytes, the largest number in flight,
    and which parameters had their gradient when the first one was issued."""

    def __init__(self, model):
        self.real = c10d.all_reduce
        self.sizes, self.in_flight, self.most_in_flight = [], 0, 0
        self.params = dict(model.module.named_parameters())
        self.done_at_first_issue = None

    def __call__(self, tensor, *args, async_op=False, **kwargs):
        work = self.real(tensor, *args, async_op=async_op, **kwargs)
        if not async_op:
            return work
        self.sizes.append(tensor.numel() * tensor.element_size())
        if self.done_at_first_issue is None:
            self.done_at_first_issue = sorted(name for name, p in self.params.items() if p.grad is not None)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        recorder = self

        class Counted:
            def wait(self):
                recorder.in_flight -= 1
                return work.wait()

        return Counted()


def _reference_grads(world: int) -> dict[str, torch.Tensor]:
    """Single process on the whole batch (the mean of the ranks' losses)."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    idx, tgt = example_batch(CONFIG, LOCAL_BATCH * world, seed=3)
    model(idx, tgt).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def run_scopes(rank: int, world: int) -> dict:
    reference = _reference_grads(world)
    out = {}
    for scope in ("blocks", "model"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = osdp.OSDP(GPT(CONFIG), default_mode="rep", compile={"scope": scope, "backend": "aot_eager"})
        idx, tgt = example_batch(CONFIG, LOCAL_BATCH * world, seed=3)
        idx, tgt = idx[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH], tgt[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH]
        recorder = _Recorder(model)
        with mock.patch.object(c10d, "all_reduce", recorder):
            model(idx, tgt).backward()
        sizes = [None] * world
        dist.all_gather_object(sizes, recorder.sizes)
        largest_param = max(p.numel() * p.element_size() for p in model.parameters())
        out[scope] = {
            "sizes_per_rank": sizes, "largest_param": largest_param, "most_in_flight": recorder.most_in_flight,
            "done_at_first_issue": recorder.done_at_first_issue,
            "vs_ref": max((p.grad - reference[name]).abs().max().item() for name, p in model.named_parameters()),
        }
    return out


@pytest.fixture(scope="module")
def scopes():
    return spawn(run_scopes, 2)


@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_rep_gradients_go_out_in_eager_buckets(scopes, scope):
    for rank in scopes:
        r = rank[scope]
        sizes = r["sizes_per_rank"][0]
        assert r["sizes_per_rank"][1] == sizes  # the same collectives, in the same order
        assert len(sizes) >= 3, sizes
        assert all(s < REPLICATE_BUCKET_BYTES + r["largest_param"] for s in sizes), sizes
        # a bucket goes out once full; only the last one of the pass may hold less
        assert all(s >= REPLICATE_BUCKET_BYTES for s in sizes[:-1]), sizes
        assert r["most_in_flight"] == 1  # MAX_INFLIGHT_REPLICATE_BUCKETS: one staging copy at a time
        assert r["vs_ref"] <= 1e-6


def test_a_bucket_goes_out_while_backward_runs_at_blocks_scope(scopes):
    """A graph per block: the first bucket (the head and the last block's gradients)
    goes out before the earlier blocks' backward ran. (In one graph every gradient is
    handed out at its end, so there the first bucket waits for all of backward.)"""
    for rank in scopes:
        done = rank["blocks"]["done_at_first_issue"]
        assert any(name.startswith("blocks.2.") for name in done), done
        assert not any(name.startswith(("blocks.0.", "blocks.1.", "wte", "wpe")) for name in done), done

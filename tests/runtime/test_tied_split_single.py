"""The tied row split in one process (a 1-rank gloo group): the head's per-slice
consumer interface (``forward_slices`` / ``backward_slices``) driving a loss that never
builds the whole logits, against plain PyTorch; gradient accumulation across
micro-batches of a tied split; the registry declaration the planner reads."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import osdp
from osdp.models import GPT, GPTConfig, example_batch
from osdp.ops import registered_split_ops
from osdp.ops.split_embedding import SplitEmbedding
from osdp.ops.split_linear_out import SplitLinearOut

pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py

VOCAB, HIDDEN, TOKENS = 53, 6, 24


class TinyLM(nn.Module):
    """Tied embedding and head around a LayerNorm."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.ln = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx, targets, per_slice_loss=False):
        h = self.ln(self.wte(idx)).reshape(-1, HIDDEN)
        if per_slice_loss:
            head = self.lm_head
            return _SliceByLoss.apply(h, targets.reshape(-1), head, *head.flat_shards)
        return F.cross_entropy(self.lm_head(h), targets.reshape(-1))


class _SliceByLoss(torch.autograd.Function):
    """Mean cross-entropy of ``x @ W^T`` computed one vocabulary slice at a time with an
    online log-sum-exp: a consumer plugged into the head's slice loop (what a fused
    head + loss kernel does); the [tokens, vocab] logits never exist."""

    @staticmethod
    def forward(ctx, x, targets, head, *shards):
        n = x.shape[0]
        run_max = torch.full((n,), float("-inf"))
        run_sum = torch.zeros(n)
        target_logit = torch.zeros(n)

        def consume(i, weight, bias, n0):
            nonlocal run_max, run_sum
            z = x @ weight.t()  # this slice's logits block: columns n0 .. n0 + ns
            new_max = torch.maximum(run_max, z.max(1).values)
            run_sum = run_sum * torch.exp(run_max - new_max) + torch.exp(z - new_max[:, None]).sum(1)
            run_max = new_max
            mine = (targets >= n0) & (targets < n0 + weight.shape[0])
            target_logit[mine] = z[mine, targets[mine] - n0]

        uses = head.forward_slices(consume, expects_backward=True)
        lse = run_max + run_sum.log()
        ctx.head, ctx.uses = head, uses
        ctx.save_for_backward(x, targets, lse)
        return (lse - target_logit).mean()

    @staticmethod
    def backward(ctx, dloss):
        x, targets, lse = ctx.saved_tensors
        head, n = ctx.head, x.shape[0]
        dx = torch.zeros_like(x)

        def consume(i, weight, grads, accumulate, n0):
            dz = torch.exp(x @ weight.t() - lse[:, None])
            mine = (targets >= n0) & (targets < n0 + weight.shape[0])
            dz[mine, targets[mine] - n0] -= 1
            dz *= dloss / n
            dx.add_(dz @ weight)
            dw = head.linear_view(grads[0])
            dw.add_(dz.t() @ x) if accumulate else dw.copy_(dz.t() @ x)

        head.backward_slices(ctx.uses, consume)
        return (dx, None, None) + (None,) * len(ctx.uses)


def _batch(seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, TOKENS // 2), generator=gen), torch.randint(0, VOCAB, (2, TOKENS // 2), generator=gen)


@pytest.mark.parametrize("modes", [("dp", "zdp", "zdp", "dp"), ("zdp", "dp", "zdp")])
def test_per_slice_consumer_of_the_tied_head_matches_pytorch(modes):
    torch.manual_seed(0)
    ref = TinyLM()
    torch.manual_seed(0)
    model = osdp.OSDP(TinyLM(), modes={"wte": modes}, default_mode="dp", prefetch_bytes=0)
    assert isinstance(model.module.lm_head, SplitLinearOut) and isinstance(model.module.wte, SplitEmbedding)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1.0)
    for step in range(2):
        idx, tgt = _batch(step)
        model.reset_memory_stats()
        loss = model(idx, tgt, per_slice_loss=True)
        loss.backward()
        ref_loss = ref(idx, tgt)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
        stats = model.memory_stats()
        assert all(stats["reduce_scatters"][f"wte[{i}]"] == 1 for i in range(len(modes)))
        # without prefetch: the kept dp units and at most one zdp slice, never the whole table
        units = {u.name: u for u in model._built.units}
        slices = [units[f"wte[{i}]"] for i in range(len(modes))]
        kept = units["ln"].gathered_bytes + sum(u.gathered_bytes for u in slices if u.mode.value == "dp")
        assert stats["peak_gathered_bytes"] <= kept + max(u.gathered_bytes for u in slices if u.mode.value == "zdp")
        assert stats["peak_gathered_bytes"] < units["ln"].gathered_bytes + sum(u.gathered_bytes for u in slices)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    state = model.full_state_dict()
    for key, value in ref.state_dict().items():  # SGD lr=1: the parameters carry the gradients
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


def test_tied_split_accumulates_micro_batches_like_pytorch():
    cfg = GPTConfig(vocab_size=61, seq_len=8, num_layers=1, hidden=8, heads=2, tie_embeddings=True)
    torch.manual_seed(3)
    ref = GPT(cfg)
    torch.manual_seed(3)
    model = osdp.OSDP(GPT(cfg), modes={"wte": ("zdp", "dp", "dp")}, default_mode="zdp")
    batches = [example_batch(cfg, 2, seed=s) for s in range(3)]
    with model.no_sync():
        for idx, tgt in batches[:2]:
            model(idx, tgt).backward()
    assert model.memory_stats()["reduce_scatters"] == {}
    model(*batches[2]).backward()
    for idx, tgt in batches:
        ref(idx, tgt).backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    state = model.full_state_dict()
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


def test_row_split_declaration_for_the_planner():
    """What the planner reads from the registry (see [Note: split op declaration])."""
    rows = registered_split_ops()["embedding_rows"]
    assert rows.axis == "rows" and rows.axis_length(nn.Embedding(50257, 4)) == 50257
    assert rows.needs_weights_in_backward is False
    head = registered_split_ops()[rows.tied_use_op]
    assert head is SplitLinearOut and head.axis == "out_features" and head.needs_weights_in_backward is True
    assert registered_split_ops()[head.tied_use_op] is rows
    # the two cut the shared weight identically (same rows, slice for slice)
    emb = nn.Embedding(11, 3)
    lin = nn.Linear(3, 11, bias=False)
    lin.weight = emb.weight
    for a, b in zip(rows.slice_tensors(emb, 4), head.slice_tensors(lin, 4)):
        assert a["weight"].data_ptr() == b["weight"].data_ptr() and a["weight"].shape == b["weight"].shape


def test_a_mode_given_to_an_unsplit_tied_use_is_its_owners():
    """A tied use is no unit of its own: ``modes={"lm_head": "dp"}`` sets the shared
    weight's unit (before, it was dropped and the embedding stayed at the default); the two
    names given different modes are refused, naming both; the names modes= takes leave the
    use out."""
    from osdp.errors import OSDPError
    from osdp.runtime.config import mode_names

    torch.manual_seed(0)
    assert mode_names(TinyLM()) == ["wte", "ln"]
    model = osdp.OSDP(TinyLM(), modes={"lm_head": "dp"}, default_mode="zdp")
    assert model.unit_modes() == {"wte": "dp", "ln": "zdp"}
    assert osdp.OSDP(TinyLM(), modes={"lm_head": "dp", "wte": "dp"}, default_mode="zdp").unit_modes()["wte"] == "dp"
    with pytest.raises(OSDPError, match=r"modes\['lm_head'\] = 'dp' but modes\['wte'\] = 'zdp'.*give it once, under 'wte'"):
        osdp.OSDP(TinyLM(), modes={"lm_head": "dp", "wte": "zdp"})

"""Per-rank bodies of ``test_user_checkpoint.py``: activation checkpointing the model's
own forward calls (``torch.utils.checkpoint``), reentrant or not, around OSDP's units:
the losses and parameters of single-process training of the same model."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import osdp
from osdp.models.gpt import Block

from .parity_cases import EPS, LR

VOCAB, SEQ, HIDDEN, HEADS = 61, 8, 16, 2
STEPS, LOCAL_BATCH = 4, 2
# split slices (dp, zdp), a dp unit, a rep unit, a frozen unit, zdp elsewhere
PLAN = {"default_mode": "zdp", "modes": {"blocks.0.mlp.c_fc": ["dp", "zdp"], "blocks.1.attn.c_attn": "dp",
                                         "ln_f": "rep"},
        "splits": {"blocks.0.mlp.c_fc": 2}}
FROZEN = "blocks.1.ln_2"


class UserCheckpointed(nn.Module):
    """A tied GPT whose forward checkpoints what ``regions`` says: ``"blocks"`` each
    block on its own, ``"cover"`` two regions that hold every unit (the embeddings and
    block 0; block 1, the final norm and the tied head), the token lookup left outside
    the first region when it is reentrant (such a checkpoint runs backward through its
    region only from an input that requires grad, which token ids cannot)."""

    def __init__(self, regions: str, reentrant: bool):
        super().__init__()
        self.regions, self.reentrant = regions, reentrant
        self.wte, self.wpe = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(SEQ, HIDDEN)
        self.blocks = nn.ModuleList(Block(HIDDEN, HEADS, 4) for _ in range(2))
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def _checkpoint(self, fn, *args):
        return checkpoint(fn, *args, use_reentrant=self.reentrant)

    def _with_positions(self, tokens):
        return tokens + self.wpe(torch.arange(tokens.shape[1]))

    def _first(self, tokens):
        return self.blocks[0](self._with_positions(tokens))

    def _last(self, h):
        return self.head(self.ln_f(self.blocks[1](h)))

    def forward(self, idx):
        if self.regions == "cover":
            if self.reentrant:
                h = self._checkpoint(self._first, self.wte(idx))
            else:
                h = self._checkpoint(lambda ids: self._first(self.wte(ids)), idx)
            return self._checkpoint(self._last, h)
        h = self._with_positions(self.wte(idx))
        for block in self.blocks:
            h = self._checkpoint(block, h)
        return self.head(self.ln_f(h))


def _model(regions: str, reentrant: bool) -> UserCheckpointed:
    torch.manual_seed(0)
    model = UserCheckpointed(regions, reentrant)
    model.get_submodule(FROZEN).requires_grad_(False)
    return model


def _batch(step: int, world: int):
    gen = torch.Generator().manual_seed(30 + step)
    return torch.randint(0, VOCAB, (LOCAL_BATCH * world, SEQ + 1), generator=gen)


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _train(model, world: int, rank: int | None) -> list[float]:
    """STEPS AdamW steps; ``rank`` None: single process on the global batch, as the mean
    of the ranks' losses (the same gradient)."""
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, eps=EPS)
    losses = []
    for step in range(STEPS):
        tokens = _batch(step, world)
        if rank is None:
            loss = sum(_loss(model, tokens[r * LOCAL_BATCH:(r + 1) * LOCAL_BATCH]) for r in range(world)) / world
        else:
            loss = _loss(model, tokens[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH])
        loss.backward()
        optim.step()
        optim.zero_grad()
        if rank is not None:
            loss = loss.detach().clone()
            torch.distributed.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    return losses


def _hf_gpt2(reentrant: bool) -> nn.Module:
    """A stock GPT-2 with Hugging Face's own checkpointing of every block."""
    import transformers

    from osdp.models.hf import GPT2_DEFAULTS

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(**{**GPT2_DEFAULTS, "vocab_size": VOCAB, "n_positions": SEQ})
    model = transformers.GPT2LMHeadModel(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    return model


class _Logits(nn.Module):
    """``model(idx)`` -> logits, for the stock model's keyword forward."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx):
        return self.model(input_ids=idx).logits


HF_PLAN = {"default_mode": "zdp", "modes": {"model.transformer.h.0.mlp.c_fc": ["dp", "zdp"],
                                            "model.transformer.h.1.attn.c_attn": "dp"},
           "splits": {"model.transformer.h.0.mlp.c_fc": 2}}


def _case(regions: str, reentrant: bool) -> tuple:
    """A fresh model of the case (the same initial weights each call) and its plan."""
    if regions == "hf_gpt2":
        return _Logits(_hf_gpt2(reentrant)), HF_PLAN
    return _model(regions, reentrant), PLAN


def run_user_checkpoint(rank: int, world: int, cases: list[tuple[str, bool]]) -> dict:
    out = {}
    for regions, reentrant in cases:
        ref, _ = _case(regions, reentrant)
        ref_losses = _train(ref, world, None)
        model, plan = _case(regions, reentrant)
        model = osdp.OSDP(model, **plan)
        losses = _train(model, world, rank)
        state = model.full_state_dict(rank0_only=False)
        out[f"{regions}-{'reentrant' if reentrant else 'non_reentrant'}"] = {
            "losses": losses, "ref_losses": ref_losses,
            "param_err": max((state[k] - v).abs().max().item() for k, v in ref.state_dict().items()),
            "gathered_after": model.gathered_units(),
        }
    return out

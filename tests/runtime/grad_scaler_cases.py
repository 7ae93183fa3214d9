"""Per-rank body of ``test_grad_scaler.py``: fp16 training with loss scaling where an
overflow lands in ONE rank's gradient shards ([Note: optimizer steps in lockstep] in
osdp/runtime/optimizer_steps.py).

The model: an embedding of tiny rows under a head of large weights, so at step
``OVERFLOW_STEP`` the embedding's gradient (head weights x output gradient, x the loss
scale) overflows fp16 on each rank while the head's (output gradient x tiny rows, and
the bias's: the output gradient summed) does not. Only the rows of the tokens seen get a
gradient, and that step's tokens all lie in rank 0's half of the rows: after the
reduce-scatter rank 0's shard holds the inf, rank 1's does not. The other steps' tokens
are spread over both halves at a loss small enough not to overflow. SGD: a parameter
moves by the learning rate times its gradient, so the comparison with FSDP2 is the
gradients' (AdamW would turn a rounding difference in a near-zero gradient into a
difference of a whole step)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

VOCAB, DIM, OUT = 64, 8, 4
STEPS, OVERFLOW_STEP, INIT_SCALE = 4, 1, 2.0**12
LR = 1.0


class TinyRowsUnderBigHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, OUT)
        with torch.no_grad():
            self.emb.weight.mul_(1e-4)
            self.head.weight.mul_(200.0)

    def forward(self, tokens):
        return self.head(self.emb(tokens))


def build() -> TinyRowsUnderBigHead:
    torch.manual_seed(0)
    return TinyRowsUnderBigHead()


def local_tokens(step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s tokens at ``step``: at OVERFLOW_STEP in rows 0..VOCAB/2 only (rank
    0's shard of the embedding), with a loss weight that overflows the scaled gradient."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    high = VOCAB // 2 if step == OVERFLOW_STEP else VOCAB
    return torch.randint(0, high, (2, 5), generator=gen)


def loss_of(out: torch.Tensor, step: int) -> torch.Tensor:
    weight = 16.0 if step == OVERFLOW_STEP else 1e-2
    return weight * out.float().pow(2).mean()


def _train(model, opt, scaler, rank: int, skip_step_on_rank0: bool = False) -> dict:
    """STEPS steps; per step the scale after it, whether this rank's shards changed, and
    whether this rank's embedding gradient was finite. An error ends the run: its type,
    message and step come back."""
    out = {"scales": [], "changed": [], "emb_grad_finite": [], "error": None}
    for step in range(STEPS):
        try:
            loss = loss_of(model(local_tokens(step, rank)), step)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        except Exception as exc:  # noqa: BLE001 - the test asserts on it
            out["error"] = (type(exc).__name__, str(exc), step)
            return out
        emb_grad = dict(model.named_parameters())["emb.weight"].grad
        out["emb_grad_finite"].append(bool(emb_grad.isfinite().all()))
        before = [p.detach().clone() for p in model.parameters()]
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
            out["scales"].append(scaler.get_scale())
        elif not (skip_step_on_rank0 and rank == 0 and step == 0):
            opt.step()
        opt.zero_grad()
        out["changed"].append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters())))
    return out


def _osdp(rank: int, scaler_kind: str, param_dtype=torch.float16, compile=None) -> dict:
    import osdp

    mp = osdp.MixedPrecision(param_dtype=param_dtype) if param_dtype is not None else None
    model = osdp.OSDP(build(), default_mode="zdp", mixed_precision=mp, compile=compile)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = {"osdp": lambda: osdp.GradScaler(model, init_scale=INIT_SCALE),
              "torch": lambda: torch.amp.GradScaler("cpu", init_scale=INIT_SCALE),
              "none": lambda: None}[scaler_kind]()
    out = _train(model, opt, scaler, rank, skip_step_on_rank0=scaler_kind == "none")
    if out["error"] is None:
        out["state"] = {k: v.clone() for k, v in model.full_state_dict(rank0_only=False).items()}
    return out


def _fsdp2(rank: int) -> dict:
    """The reference: FSDP2 in the same fp16 math with FSDP's ShardedGradScaler."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    model = build()
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = ShardedGradScaler("cpu", init_scale=INIT_SCALE)
    out = {"scales": [], "losses": []}
    for step in range(STEPS):
        loss = loss_of(model(local_tokens(step, rank)), step)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        out["scales"].append(scaler.get_scale())
    out["state"] = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
    return out


def run(rank: int, world: int) -> dict:
    torch._dynamo.reset()
    out = {"osdp": _osdp(rank, "osdp"), "torch": _osdp(rank, "torch"),
           "osdp_compiled": _osdp(rank, "osdp", compile={"backend": "aot_eager"}),
           "uneven_step": _osdp(rank, "none", param_dtype=None), "fsdp2": _fsdp2(rank)}
    dist.barrier()
    return out


# ---- a mean that fits fp16 whose sum does not ([Note: fp16 gradient average]) -------------
MEAN_OVERFLOW_INPUT = 40000.0  # each rank's gradient; the sum of 2, 80000, is past fp16's 65504


def _mean_overflow_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4, bias=False))


def _mean_overflow_grads(model, rank: int) -> list[torch.Tensor]:
    model(torch.full((1, 4), MEAN_OVERFLOW_INPUT)).float().sum().backward()
    return [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone() for p in model.parameters()]


def run_mean_overflow(rank: int, world: int) -> dict:
    """Each parameter's gradient (this rank's shard, or whole) under fp16 compute: eager
    and compiled, sharded and replicated; FSDP2's as the reference."""
    import osdp
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    out = {}
    for name, kwargs in {"zdp": {"default_mode": "zdp"}, "rep": {"default_mode": "rep"},
                         "zdp_compiled": {"default_mode": "zdp", "compile": {"backend": "aot_eager"}},
                         "rep_compiled": {"default_mode": "rep", "compile": {"backend": "aot_eager"}}}.items():
        torch._dynamo.reset()
        model = osdp.OSDP(_mean_overflow_model(), mixed_precision=osdp.MixedPrecision(torch.float16), **kwargs)
        out[name] = _mean_overflow_grads(model, rank)
    fsdp2 = _mean_overflow_model()
    fully_shard(fsdp2, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
    out["fsdp2"] = _mean_overflow_grads(fsdp2, rank)
    dist.barrier()
    return out

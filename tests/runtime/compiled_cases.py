"""The compiled path on 2 gloo ranks: per case, OSDP compiled, OSDP eager and
single-process training on the whole batch (3 AdamW steps with clipping), and what the
compiler made of it (graphs, graph breaks, all-gathers in the forward and backward
graphs). Run inside one spawn per test (tests/runtime/test_compiled.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

import osdp
from osdp.contract import DEFAULT_COALESCE_BYTES
from osdp.models.gpt import GPT, GPTConfig, example_batch

STEPS = 3
LOCAL_BATCH = 2
LR = 1e-2
EPS = 1e-5  # AdamW's eps: keeps the rounding of near-zero gradients from being amplified
_C10D = torch.ops._c10d_functional


@dataclass
class Case:
    name: str
    kwargs: dict  # OSDP keyword arguments besides compile=
    layers: int = 2
    tie: bool = False
    scope: str = "model"  # CompileConfig's default
    extra: dict = field(default_factory=dict)
    # run inductor's small-gather coalescing on the aot_eager graphs too (inductor runs
    # it itself: [Note: compiled small units coalesced]), with kwargs' coalesce_bytes
    coalesce: bool = False


def counting_backend(seen: dict, coalesce_bytes: int = 0):
    """aot_eager, counting the all-gathers that the forward and backward graphs run
    (each call of a graph adds its all-gathers); ``coalesce_bytes``: the graphs are
    first given the pass inductor runs after AOT autograd, which merges small units'
    gathers (osdp/runtime/compiled_coalesce.py)."""
    from osdp.runtime.compiled_coalesce import SmallUnitCoalescing
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def compiler(kind):
        def compile_graph(gm, example_inputs):
            if coalesce_bytes:
                SmallUnitCoalescing(coalesce_bytes)(gm.graph)
                gm.recompile()
            gathers = sum(1 for n in gm.graph.nodes if n.target == _C10D.all_gather_into_tensor.default)
            run = make_boxed_func(gm.forward)

            def counted(args):
                seen[kind] += gathers
                return run(args)
            counted._boxed_call = True
            return counted
        return compile_graph

    return aot_autograd(fw_compiler=compiler("fw"), bw_compiler=compiler("bw"),
                        partition_fn=min_cut_rematerialization_partition)


def mean_over_ranks(loss: torch.Tensor, world: int) -> float:
    """The mean of the ranks' losses: the single process's loss on the whole batch."""
    value = loss.detach().clone()
    dist.all_reduce(value)
    return value.item() / world


def _gpt(case: Case) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=96, seq_len=8, num_layers=case.layers, hidden=32, heads=4,
                         tie_embeddings=case.tie))


def _train(model, rank, world, cfg, clip=True, after_step=lambda step: None):
    """STEPS AdamW steps on this rank's slice of the global batch (``rank`` None: all of
    it, single process); the per-step losses (mean over ranks)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        idx, tgt = example_batch(cfg, LOCAL_BATCH * world, seed=10 + step)
        if rank is not None:
            idx, tgt = idx[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH], tgt[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH]
        loss = model(idx, tgt)
        loss.backward()
        if clip:
            (model.clip_grad_norm_ if rank is not None else
             lambda n: torch.nn.utils.clip_grad_norm_(model.parameters(), n))(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item() if rank is None else mean_over_ranks(loss, world))
        after_step(step)
    return losses


def trained(compiled, eager_state: dict, ref) -> dict:
    """After training: the largest elementwise distances of the full state dicts (compiled
    to eager OSDP, compiled and eager OSDP to the single process ``ref``), and what the
    compiler made of ``compiled`` (graph breaks, regions, units' modes)."""
    state, reference = compiled.full_state_dict(rank0_only=False), ref.state_dict()
    return {"vs_eager": max((state[k] - eager_state[k]).abs().max().item() for k in reference),
            "vs_ref": max((state[k] - v).abs().max().item() for k, v in reference.items()),
            "eager_vs_ref": max((eager_state[k] - v).abs().max().item() for k, v in reference.items()),
            "breaks": sum(counters["graph_break"].values()),
            "break_reasons": [str(k)[:300] for k in counters["graph_break"]],
            "regions": compiled.compiled_regions, "units": compiled.unit_modes()}


def run_case(rank: int, world: int, case: Case) -> dict:
    torch._dynamo.reset()
    counters.clear()
    ref = _gpt(case)
    cfg = ref.config
    ref_losses = _train(ref, None, world, cfg)
    eager = osdp.OSDP(_gpt(case), **case.kwargs)
    eager_losses = _train(eager, rank, world, cfg)
    eager_state = eager.full_state_dict(rank0_only=False)
    seen = {"fw": 0, "bw": 0}
    coalesce_bytes = case.kwargs.get("coalesce_bytes", DEFAULT_COALESCE_BYTES) if case.coalesce else 0
    compiled = osdp.OSDP(_gpt(case), compile={"scope": case.scope, "backend": counting_backend(seen, coalesce_bytes)},
                         **case.kwargs)
    graphs, gathers = [], {}

    def record(step):
        graphs.append(counters["stats"]["unique_graphs"])
        if step == 0:
            gathers.update(seen)

    opt_losses = _train(compiled, rank, world, cfg, after_step=record)
    return {"losses": opt_losses, "eager_losses": eager_losses, "ref_losses": ref_losses, "graphs": graphs,
            "gathers": gathers, **trained(compiled, eager_state, ref)}


def run_cases(rank: int, world: int, cases: list[Case]) -> dict:
    return {case.name: run_case(rank, world, case) for case in cases}


def run_hf(rank: int, world: int, key: str, raw: bool, kwargs: dict, scope: str, backend="aot_eager") -> dict:
    """A stock Hugging Face model (tests/hf/hf_cases.py) compiled and eager: per-step
    mean losses, graphs, graph breaks."""
    from hf.hf_cases import _local, global_batch, make_model

    from osdp.models.hf import hf_loss

    out = {}
    for name, compile_arg in (("eager", None), ("compiled", {"scope": scope, "backend": backend})):
        torch._dynamo.reset()
        counters.clear()
        model = osdp.OSDP(make_model(key, raw=raw), compile=compile_arg, **kwargs)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
        losses = []
        for step in range(STEPS):
            batch = _local(global_batch(key, step, world), rank)
            loss = hf_loss(model, *batch) if raw else model(*batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(mean_over_ranks(loss, world))
        out[name] = {"losses": losses, "graphs": counters["stats"]["unique_graphs"],
                     "breaks": sum(counters["graph_break"].values()),
                     "break_reasons": [str(k)[:300] for k in counters["graph_break"]]}
    return out


def run_hf_cases(rank: int, world: int, cases: list[tuple]) -> dict:
    return {case[0]: run_hf(rank, world, *case[1:]) for case in cases}


def run_auto(rank: int, world: int) -> dict:
    """Auto mode with compile=: the chosen plan measured compiled, recorded, reported."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=96, seq_len=8, num_layers=2, hidden=32, heads=4)
    idx, tgt = example_batch(cfg, 4)
    model = osdp.OSDP(GPT(cfg), memory_limit="64MiB", example_inputs=(idx, tgt), compile={"backend": "aot_eager"},
                      auto_kwargs={"budget_s": 60, "use_plan_cache": False})
    loss = model(idx[:model.batch_size], tgt[:model.batch_size])
    loss.backward()
    return {"report": model.report(), "compiled": model.plan.calibration.compiled, "regions": model.compiled_regions,
            "plan_hash": model.plan.plan_hash(),
            "loss": loss.item(), "measured": model.plan.measured,
            "observations": [o["measured"] for o in model.plan.calibration.observations or ()]}


def run_idioms(rank: int, world: int) -> dict:
    """A frozen block, ``torch.autograd.grad`` of a rep unit's weight (a gradient
    penalty's idiom: this rank's gradient, ``.grad`` untouched), two backward passes
    accumulating into ``.grad``, ``eval()`` under ``no_grad``, the full state dict: eager
    and compiled side by side."""
    cfg = GPTConfig(vocab_size=96, seq_len=8, num_layers=2, hidden=32, heads=4)
    seen = {}
    for name, compile_arg in (("eager", None), ("compiled", {"backend": "aot_eager"})):
        torch.manual_seed(0)
        gpt = GPT(cfg)
        for p in gpt.blocks[0].parameters():
            p.requires_grad_(False)
        model = osdp.OSDP(gpt, default_mode="zdp", modes={"blocks.1.mlp.c_fc": "dp", "ln_f": "rep"},
                          compile=compile_arg)
        idx, tgt = example_batch(cfg, 4, seed=rank)
        ln_f = dict(model.named_parameters())["ln_f.weight"]
        (local,) = torch.autograd.grad(model(idx, tgt), [ln_f])
        untouched = ln_f.grad is None
        for i in range(2):
            model(idx[2 * i:2 * i + 2], tgt[2 * i:2 * i + 2]).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        marked = getattr(ln_f.grad, "_osdp_replicated", False)  # torch's clip_grad_norm_ reads it
        model.eval()
        with torch.no_grad():
            eval_loss = model(idx, tgt).item()
        model.train()
        seen[name] = {"grads": grads, "eval_loss": eval_loss, "state": model.full_state_dict(rank0_only=False),
                      "autograd_grad": local, "untouched": untouched, "marked": marked,
                      "no_grad": sorted(n for n, p in model.named_parameters() if p.grad is None)}
    eager, compiled = seen["eager"], seen["compiled"]
    return {
        "grad_names": (sorted(eager["grads"]), sorted(compiled["grads"])),
        "grad_diff": max((eager["grads"][k] - compiled["grads"][k]).abs().max().item()
                         for k in eager["grads"] if eager["grads"][k].numel()),
        "eval_losses": (eager["eval_loss"], compiled["eval_loss"]),
        "autograd_grad": (eager["autograd_grad"], compiled["autograd_grad"]),
        "untouched": (eager["untouched"], compiled["untouched"]),
        "marked": (eager["marked"], compiled["marked"]),
        "frozen": (eager["no_grad"], compiled["no_grad"]),
        "state_diff": max((eager["state"][k] - compiled["state"][k]).abs().max().item() for k in eager["state"]),
    }


def run_models_side_by_side(rank: int, world: int) -> dict:
    """Three compiled models with different plans in one process, a step each, with
    dynamo told to fail where it would fall back to eager (``recompile_limit``, 8, hit):
    the error, if any. Each GPT compiles its block, two embeddings, final norm and head:
    past 8 entries when every region shared one code object (measured: it failed).
    Dynamo's cache is the subject: its ``eager`` backend (no AOT autograd) suffices."""
    torch._dynamo.reset()
    cfg = GPTConfig(vocab_size=96, seq_len=8, num_layers=1, hidden=32, heads=4)
    models = []
    for kwargs in ({"default_mode": "zdp"}, {"default_mode": "dp"}, {"modes": {"ln_f": "rep"}}):
        torch.manual_seed(0)
        models.append(osdp.OSDP(GPT(cfg), compile={"scope": "blocks", "backend": "eager"}, **kwargs))
    idx, tgt = example_batch(cfg, 2, seed=rank)
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            for model in models:
                model(idx, tgt).backward()
    except Exception as e:  # noqa: BLE001  (the result to check)
        return {"error": f"{type(e).__name__}: {e}"[:500]}
    return {"error": ""}


def run_outer_compile(rank: int, world: int) -> dict:
    """``torch.compile(model)`` of a model wrapped without ``compile=`` (README: it runs,
    breaking the graph at every unit): its losses and state beside the eager model's.
    OSDP marks its modules as FSDP's ([Note: ranks in lockstep]), which Dynamo reads."""
    torch._dynamo.reset()
    case = Case("outer", {"default_mode": "zdp"})
    cfg = _gpt(case).config
    eager = osdp.OSDP(_gpt(case), **case.kwargs)
    wrapped = osdp.OSDP(_gpt(case), **case.kwargs)
    outer = torch.compile(wrapped, backend="aot_eager")
    counters.clear()
    losses = (_train(outer, rank, world, cfg), _train(eager, rank, world, cfg))
    # dynamo tracing into the scheduler's entry points (one wrapper shared by all of them,
    # recompiled per argument count until dynamo's recompile limit)
    scheduler_traced = sum(n for reason, n in counters["unimplemented"].items()
                           if "is_inference_mode_enabled" in reason)
    states = (wrapped.full_state_dict(rank0_only=False), eager.full_state_dict(rank0_only=False))
    return {"losses": losses, "state_diff": max((states[0][k] - v).abs().max().item() for k, v in states[1].items()),
            "scheduler_traced": scheduler_traced, "graphs": counters["stats"]["unique_graphs"]}


def run_all(rank: int, world: int, cases: list[Case]) -> dict:
    return {"cases": run_cases(rank, world, cases), "idioms": run_idioms(rank, world),
            "side_by_side": run_models_side_by_side(rank, world), "outer": run_outer_compile(rank, world)}

"""What ``torch.compile`` compiles on the compiled path (osdp/runtime/compiled.py): one
region per transformer block and per unit outside the blocks (``scope="blocks"``) or
the whole model (``scope="model"``), each region entered through a forward whose code
object is its own.

[Note: one code object per region plan]
Dynamo keeps compiled code per code object (the first frame it traces: a region's
``forward``) and, past ``torch._dynamo.config.recompile_limit`` (8) entries on one,
runs that frame eagerly with only a warning. A block's units differ by plan (which
are ``dp``, which ``zdp``, which split) and dynamo guards on it, so every distinct
block plan is an entry on the block class's one ``forward``: measured, a 10-layer GPT
whose blocks had 10 different plans compiled 8 of them and ran the other two eagerly
(with ``fail_on_recompile_limit_hit`` it raised). The planner's per-operator plans
give exactly that, on the deep models compile is for. So each region's module gets a
subclass, one per (class, checkpointed or not, :func:`region_signature`) in each
wrapped model, whose ``forward`` has a code object of its own and calls the class's
forward. Blocks with the same plan share a subclass and so one compiled graph (as
torchtitan's per-block compile shares it across identical layers: dynamo guards on
the module's structure, not its identity); blocks with different plans never share a
cache; two wrapped models never do (auto mode compiles several trials in one
process, [Note: compiled plans] in osdp/compiled_choice.py).

A checkpointed block's subclass runs its forward under non-reentrant checkpoint with
the compiled path's policy (``context_fn``), in place of
:func:`~osdp.runtime.activation_checkpoint.apply_checkpointing`'s instance-level
forward: a function set on the instance is one code object for every checkpointed
block of every model, the cache this note keeps apart.

[Note: compile scope]
``scope="blocks"`` makes a graph per transformer block and per unit outside the blocks;
blocks with one plan share theirs, so compile time grows with the number of distinct
block plans, not with depth. But OSDP's overlap pass orders collectives within one
graph ([Note: compiled prefetch] in compiled_prefetch.py), so at each graph boundary
the next graph's first gather and this graph's last reduction wait are exposed, where
eager OSDP (and FSDP2's eager hooks around its per-block graphs) prefetch across
blocks. ``scope="model"`` (the default) is one graph: every gather prefetched, every
reduction overlapped, at the cost of tracing every layer. Measured (``python
bench/compile.py``: 2 gloo ranks on a 2-core CPU, each model's middle-budget auto plan,
9 interleaved rounds, medians, cold inductor caches; two runs, bench/results/
compile_cpu_scopes{,_run2}.log; gain = eager step / compiled step; compile = first step
- steady step, first run):

  model        FSDP2 gain    OSDP "blocks"  OSDP "model"  compile s: FSDP2, "blocks", "model"
  N&D 12x128   1.01x, 1.13x  0.96x, 0.97x   1.08x, 1.12x  20, 54, 88
  W&S 2x768    1.01x, 1.05x  1.00x, 0.95x   1.03x, 0.91x  23, 45, 61

A third run on a faster machine (15 rounds, compile_cpu_scopes_run3.log): N&D 1.01x,
0.96x, 1.04x (compile 10, 31, 37 s); W&S 1.01x, 0.94x, 0.91x, its auto plan there every
unit ``rep`` (compiled, their gradients are all-reduced once backward hands them out,
at the end at model scope: [Note: rep gradients bucketed] in compiled_rep_grads.py).
Runs 4 and 6 (2026-11-28, a slower machine, 15 rounds; from run 4 on, each compiled
peer runs the plan compiled auto mode makes for its scope, [Note: compiled plans] in
osdp/compiled_choice.py, and gain = compiled samples/s / eager samples/s): N&D 1.03x,
1.00x, 1.13x (run 4) and 1.02x, 0.99x, 1.07x (run 6), compile 14-16, 31-35, 58-65 s;
W&S in run 6, both scopes' auto mode keeping every unit ``zdp`` at batch 20 (its
finalist, every unit ``rep`` at batch 9, measured slower compiled): 0.89x, 0.99x,
0.96x (FSDP2's compiled step slower than its eager one that run); in run 4 the model
scope's auto mode had kept the ``rep`` plan on a noisy measurement (0.90x), which the
compiled choice now measures again. Run 8 (2026-11-28, small units' collectives
coalesced: [Note: compiled small units coalesced] in compiled_coalesce.py; the N&D plans
keep their norms ``rep``, so it moves them little): N&D 1.01x, 0.96x, 1.02x; W&S 0.99x,
0.98x, 0.99x (bench/results/compile_cpu_scopes_run8.log).

N&D (12 small blocks: collectives and per-op overhead weigh) gains from one graph in
both runs; W&S (2 wide blocks, matmul-bound on CPU) shows no difference beyond this
machine's noise. On one H200 (one rank, N&D with every unit ``rep``, batch 6, 15
interleaved steps; a scratch script's phases in bench/results/gpu_20261127_b/README.txt):
eager 30.5 ms, "blocks" 30.4 ms, "model" 24.8 ms. Memory: what the partitioner saves for
backward is about the same at both scopes (N&D all ``zdp``, batch 3: 25.6 MiB across
the per-block graphs, 26.3 MiB in the one graph; 0.7 MiB is about the loss's logits,
0.75 MiB, which eager autograd saves outside the per-block graphs: not checked tensor
by tensor). ``"blocks"`` stays for deep
models whose compile time matters more than a few percent of each step, and for runs
that recompile often.

Where the per-block graphs' time goes (``python bench/compile_phases.py``, N&D 12x128,
batch 3, 2 gloo ranks, 9 rounds, medians, 2026-11-28): with every unit ``zdp`` the
block graphs' forward took 99.7 ms and backward 180.7 against 78.4 and 148.5 in one
graph; with every unit ``rep`` (no gathers, gradients bucketed outside the graphs) 37.1
and 82.8 against 29.7 and 76.1. So about a quarter of the gap is the graphs themselves (16
graphs' guards and autograd wrappers, about 0.2 ms each per step on one rank, and the
loss outside them) and the rest the exposed collectives. Tried and not kept: each
graph's first gather issued by the graph before it, while that graph's last unit
computes (a post-grad rewrite of the first gather into an opaque op that takes a
buffer gathered ahead, and an op after the last gather's wait that gathers the next
graph's first units, learnt from the pass before). It kept parity, but gained nothing
here (same model, 21 rounds, the slower rank: blocks 266.1 ms with it, 260.6 without;
model scope, where it prefetched the backward graph's first gather, 223.5 and 220.0).
Likely (not measured apart): its two Python ops per graph cost what hiding a gloo
gather saves when both ranks' compute fills the two cores. Untried on a GPU, where
gathers take longer.
"""
from __future__ import annotations

import inspect
import types

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ..module_tree import signature_or_none, transformer_blocks, with_self

def region_signature(module: nn.Module) -> tuple:
    """What the compiled graph of ``module`` depends on besides its class: per
    submodule, its path, class and, where it computes with units, how each unit is
    gathered (mode, layout of this rank's shard, slots, dtypes; the runner's
    ``signature()``). Equal for blocks of one class with one plan."""
    return tuple((name, type(sub), getattr(sub.__dict__.get("_osdp_compiled"), "signature", lambda: None)())
                 for name, sub in module.named_modules())


class RegionClasses:
    """One wrapped model's region subclasses, by (base class, checkpoint policy,
    signature); see [Note: one code object per region plan]."""

    def __init__(self):
        self.classes: dict[tuple, type] = {}
        self.made: set[type] = set()  # the values of ``classes``

    def give(self, module: nn.Module, signature: tuple, context_fn=None) -> None:
        """Swap ``module`` to the subclass for its class, checkpointing (``context_fn``,
        torch's selective-checkpoint contexts; None: not checkpointed) and signature.
        A module given one already keeps it (a checkpointed block that is also a
        region). A forward set on the instance (a user's, or a library hook's) is
        taken off it and runs from a subclass of its own: shared with no other module,
        since it is that instance's."""
        if type(module) in self.made:
            return
        base = type(module)
        own = module.__dict__.pop("forward", None)
        key = (base, context_fn, signature, own)
        cls = self.classes.get(key)
        if cls is None:
            name = f"forward_region{len(self.classes)}_{base.__name__}"
            base_forward = base.forward if own is None else _calling(own)
            forward = _region_forward(base_forward, context_fn, name, f"{base.__name__}.{name}")
            # Hugging Face reads the forward's parameters (generate's model_kwargs check)
            forward.__signature__ = _shown_signature(base.forward if own is None else own, own is not None)
            cls = self.classes[key] = type(base.__name__, (base,), {"forward": forward,
                                                                    "__module__": base.__module__})
            self.made.add(cls)
        module.__class__ = cls


def _shown_signature(fn, bound: bool) -> inspect.Signature | None:
    """The signature a region's forward shows: the original forward's (``self`` first
    where ``fn`` is an instance's bound method)."""
    signature = signature_or_none(fn)
    return with_self(signature) if bound and signature is not None else signature


def _calling(own):
    """An instance's own forward as a function of (module, *args)."""
    def forward(_module, *args, **kwargs):
        return own(*args, **kwargs)
    return forward


def _region_forward(base_forward, context_fn, name: str, qualname: str):
    """``base_forward`` called from a function with a code object of its own, under
    checkpoint with ``context_fn`` when given and gradients are on."""
    def forward(self, *args, **kwargs):
        if context_fn is None or not torch.is_grad_enabled():
            return base_forward(self, *args, **kwargs)

        def run(*inner_args, **inner_kwargs):
            return base_forward(self, *inner_args, **inner_kwargs)
        return checkpoint(run, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return with_own_code(forward, name, qualname)


def with_own_code(fn, name: str, qualname: str):
    """A copy of ``fn`` (its globals, defaults and closure) whose code object is its
    own: dynamo keeps compiled code per code object."""
    code = fn.__code__.replace(co_name=name, co_qualname=qualname)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def inside_any(blocks) -> callable:
    """``path`` -> whether it is one of ``blocks`` or inside one."""
    blocks = tuple(blocks)

    def inside(path: str) -> bool:
        return any(path == b or path.startswith(b + ".") for b in blocks)
    return inside


def region_paths(model: nn.Module, unit_paths: list[str], scope: str) -> tuple[list[str], list[str]]:
    """The paths ``scope`` compiles, in order: the blocks (``[""]``, the model, for
    ``"model"``; else the blocks computing with units, not a ModuleList of Identity
    bridges) and the regions outside them: each unit's module outside the blocks, on
    its own (a ``zdp`` unit's recompute needs a graph, [Note: units outside the
    blocks] in compiled.py)."""
    if scope == "model":
        return [""], []
    blocks = [b for b in transformer_blocks(model) if any(inside_any((b,))(p) for p in unit_paths)]
    inside = inside_any(blocks)
    outside = []
    for path in unit_paths:
        if not inside(path) and path not in outside:
            outside.append(path)
    return blocks, outside


def compile_each(model: nn.Module, regions: list[str], classes: RegionClasses, compile_kwargs: dict) -> None:
    """``torch.compile`` each region in place, each with its region subclass."""
    for path in regions:
        module = model.get_submodule(path)
        classes.give(module, region_signature(module))
        module.compile(**compile_kwargs)

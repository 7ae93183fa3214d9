"""A mixture of experts' experts (``transformers`` 5: one module of 3-D weights per
layer, ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]) split by experts.

[Note: experts split]
A layer's experts are most of its weights (Mixtral-8x7B: 5.25 GiB a layer in fp32),
and as one unit they are gathered whole. Split, they are gathered a group of experts at
a time. Each slice cuts ONE parameter ([Note: split parameters] in
osdp/runtime/split_params.py: a cut parameter is one tensor per rank over its slices),
so ``g = 2m`` slices are two phases over the same ``m`` groups of ``E / m`` experts:

- slices ``0 .. m-1``: ``gate_up_proj`` of group ``j``; slices ``m .. 2m-1``:
  ``down_proj`` of group ``j`` (half the bytes of a ``gate_up`` slice);
- forward: the routed rows sorted by expert (as transformers' grouped-matmul forward
  does); each ``gate_up`` slice computes its experts' rows of the pre-activation
  (acquired, used, released: a zdp slice is freed at once), then the gate (the
  module's own ``_apply_gate``) on all rows, then each ``down`` slice its experts' rows
  of the output; the rows weighted by the router and summed per token as transformers
  does (``view(T, k, H).sum(1)``);
- backward in reverse: each ``down`` slice (gathered again if zdp) its experts' part of
  dA and its dW, then the gate's backward (autograd on the saved pre-activation), then
  each ``gate_up`` slice its part of dX and its dW; the router weights' gradient is the
  weighted rows' inner product with dOut.
Saved: the sorted input rows' source (the layer input and the order), the
pre-activation and the expert outputs; what the unsplit grouped matmul saves is the
same up to the gate's output, recomputed here from the pre-activation.

Supported: the layout of Mixtral, Qwen2/3-MoE, OLMoE and DeepSeek-V3 (a gate, the
gate and up halves concatenated, no biases, not transposed, no norm after the experts,
no expert parallelism); another layout (GPT-OSS: biases, transposed weights) is refused
by name. Each expert's rows are one matmul (a loop over the group's experts: the rows
per expert are read on the host, one synchronization per layer on a GPU). The planner
does not price this op yet (``planned = False``): it runs where asked, ``splits=`` or a
plan made by hand; auto mode keeps the experts one unit.
"""
from __future__ import annotations

import types

import torch
import torch.nn as nn

from ..errors import OSDPError
from .registry import SplitModule, register_split_op, registered_split_ops

_LAYOUT = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
           "has_post_expert_norm": False, "_is_expert_parallel": False}


def is_experts_type(module_type: type) -> bool:
    """A ``transformers`` experts class (its ``__init__`` set up by
    ``use_experts_implementation``, which gives it ``_apply_gate``)."""
    return (issubclass(module_type, nn.Module) and hasattr(module_type, "_apply_gate")
            and module_type.__module__.startswith("transformers."))


def experts_op(module_type: type) -> type[SplitModule]:
    """The split op of ``module_type``, registered on first use (one op per class: the
    registry keys ops by exact module type)."""
    op_name = f"experts_{module_type.__name__.lower()}"
    existing = registered_split_ops().get(op_name)
    if existing is not None and existing.module_type is module_type:
        return existing
    return register_split_op(type(f"Split{module_type.__name__}", (ExpertsSplit,),
                                  {"module_type": module_type, "op_name": op_name, "__module__": __name__}))


class _SplitExpertsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, top_k_index, top_k_weights, expects_backward: bool, module: "ExpertsSplit", *shards):
        route = module.route(top_k_index)
        x_rows = hidden[route.tokens].to(module.compute_dtype)  # as transformers casts to the weights'
        pre, uses_up = module.phase(0, x_rows, 2 * module.intermediate_size, route, expects_backward)
        act = module.gate(pre)
        out_rows, uses_down = module.phase(module.groups, act, module.hidden_size, route, expects_backward)
        weights = top_k_weights.reshape(-1)[route.perm]
        weighted = out_rows * weights.unsqueeze(-1).to(out_rows.dtype)
        # back in token order, summed over each token's k experts, as transformers does
        out = weighted[route.inverse].view(*top_k_index.shape, -1).sum(dim=1)
        ctx.module, ctx.route, ctx.uses = module, route, uses_up + uses_down
        ctx.save_for_backward(hidden, top_k_weights, pre, out_rows)
        return out.to(hidden.dtype)

    @staticmethod
    def backward(ctx, d_out):
        module, route = ctx.module, ctx.route
        module.refuse_create_graph()
        wanted = module.wanted_grads(ctx)  # asked before the autograd.grad below starts a pass of its own
        hidden, top_k_weights, pre, out_rows = ctx.saved_tensors
        weights = top_k_weights.reshape(-1)[route.perm].to(out_rows.dtype)
        d_weighted = d_out[route.tokens].to(out_rows.dtype)  # each row's token's gradient
        d_weights = None
        if ctx.needs_input_grad[2]:
            d_weights = torch.zeros(route.perm.numel(), dtype=top_k_weights.dtype, device=d_out.device)
            d_weights[route.perm] = (d_weighted * out_rows).sum(-1).to(top_k_weights.dtype)
            d_weights = d_weights.view_as(top_k_weights)
        with torch.enable_grad():
            pre_leaf = pre.detach().requires_grad_()
            act = module.gate(pre_leaf)
        uses_up, uses_down = ctx.uses[:module.groups], ctx.uses[module.groups:]
        d_act = module.down_backward(d_weighted * weights.unsqueeze(-1), act.detach(), route, uses_down,
                                     wanted[module.groups:])
        (d_pre,) = torch.autograd.grad(act, pre_leaf, d_act)
        d_hidden = None
        x_rows = hidden[route.tokens].to(module.compute_dtype)
        d_rows = module.gate_up_backward(d_pre, x_rows, route, uses_up, wanted[:module.groups],
                                         need_dx=ctx.needs_input_grad[0])
        if d_rows is not None:
            d_hidden = torch.zeros_like(hidden).index_add_(0, route.tokens, d_rows.to(hidden.dtype))
        return (d_hidden, None, d_weights, None, None) + (None,) * module.g


class Route(types.SimpleNamespace):
    """Where each (token, expert) row goes: ``perm`` sorts the flattened top-k choices
    by expert (stable), ``tokens`` the token of each sorted row, ``inverse`` undoes the
    sort, ``bounds[e]`` expert ``e``'s rows (host integers)."""


class ExpertsSplit(SplitModule):
    """Base of the per-class experts ops ([Note: experts split]); :func:`experts_op`
    makes one per ``transformers`` experts class."""

    axis = "rows"  # experts, in two phases: 2E slices at most
    planned = False  # the cost model does not price it yet
    default_for_type = True

    def __init__(self, module: nn.Module, g: int):
        super().__init__(g)
        self.num_experts, two_i, self.hidden_size = module.gate_up_proj.shape
        self.intermediate_size = two_i // 2
        self.groups = g // 2
        self.per_group = self.num_experts // self.groups
        self.act_fn = module.act_fn
        # the module's own gate (the default one reads self.act_fn)
        self._apply_gate = types.MethodType(type(module)._apply_gate, self)

    # ---- SplitModule --------------------------------------------------------------------------
    @classmethod
    def axis_length(cls, module: nn.Module) -> int:
        return 2 * module.gate_up_proj.shape[0]

    @classmethod
    def check(cls, module: nn.Module, g: int, name: str) -> None:
        wrong = {k: getattr(module, k, None) for k, v in _LAYOUT.items() if getattr(module, k, None) != v}
        if wrong:
            raise OSDPError(
                f"cannot split {name!r} ({type(module).__name__}): the experts split takes the layout of Mixtral, "
                f"Qwen-MoE, OLMoE and DeepSeek-V3 ({', '.join(f'{k}={v}' for k, v in _LAYOUT.items())}); this "
                f"module has {', '.join(f'{k}={v}' for k, v in wrong.items())}: leave it unsplit"
            )
        experts = module.gate_up_proj.shape[0]
        if g < 2 or g % 2 or experts % (g // 2):
            valid = [2 * m for m in range(1, experts + 1) if experts % m == 0]
            raise OSDPError(
                f"cannot split {name!r} ({type(module).__name__}, {experts} experts) into {g} slices: the experts "
                f"split makes g = 2m slices (gate_up then down, m groups of E/m experts each), so g is one of "
                f"{valid}"
            )

    @classmethod
    def slice_tensors(cls, module: nn.Module, g: int) -> list[dict[str, torch.Tensor]]:
        groups = g // 2
        per = module.gate_up_proj.shape[0] // groups
        gate_up, down = module.gate_up_proj.detach(), module.down_proj.detach()
        return ([{"gate_up_proj": gate_up.narrow(0, j * per, per)} for j in range(groups)]
                + [{"down_proj": down.narrow(0, j * per, per)} for j in range(groups)])

    @classmethod
    def merge(cls, slices: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {"gate_up_proj": torch.cat([s["gate_up_proj"] for s in slices if "gate_up_proj" in s]),
                "down_proj": torch.cat([s["down_proj"] for s in slices if "down_proj" in s])}

    # ---- routing and the two phases --------------------------------------------------------------
    def route(self, top_k_index: torch.Tensor) -> Route:
        k = top_k_index.shape[-1]
        expert_ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), device=perm.device)
        counts = torch.bincount(expert_ids, minlength=self.num_experts).tolist()
        bounds, start = [], 0
        for n in counts:
            bounds.append((start, start + n))
            start += n
        return Route(perm=perm, tokens=perm // k, inverse=inverse, bounds=bounds)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The gathered slices' dtype (mixed precision's ``param_dtype``)."""
        return self.units[0].views[0].dtype

    def gate(self, pre: torch.Tensor) -> torch.Tensor:
        return self._apply_gate(pre)

    def _experts_of(self, j: int) -> range:
        return range(j * self.per_group, (j + 1) * self.per_group)

    def phase(self, first: int, x_rows, width: int, route: Route, expects_backward: bool):
        """Each expert's rows of ``x_rows @ W_e^T`` (``width`` columns), slice by slice over
        the phase's slices ``first .. first + m - 1`` (``gate_up``: 0, [E/m, 2I, H] each;
        ``down``: m, [E/m, H, I]); the result and the slices' uses."""
        sched = self.scheduler
        out = x_rows.new_empty(x_rows.shape[0], width)
        uses = []
        for j in range(self.groups):
            unit = self.units[first + j]
            use = sched.pre_forward(unit)
            weight = unit.views[0]
            for local, e in enumerate(self._experts_of(j)):
                r0, r1 = route.bounds[e]
                if r1 > r0:
                    torch.mm(x_rows[r0:r1], weight[local].t(), out=out[r0:r1])
            sched.post_forward(use, expects_backward, True)
            uses.append(use)
        return out, uses

    def down_backward(self, d_out_rows, act, route: Route, uses, wanted: list[bool]) -> torch.Tensor:
        """dA of every row, and each ``down`` slice's dW (where ``wanted``: [Note: weight
        gradients a backward wants] in registry.py), slices in reverse."""
        d_act = torch.empty_like(act)
        for j in reversed(range(self.groups)):
            unit = self.units[self.groups + j]
            self._slice_backward(unit, uses[j], j, route, d_out_rows, act, d_act, wanted[j])
        return d_act

    def gate_up_backward(self, d_pre, x_rows, route: Route, uses, wanted: list[bool], need_dx: bool):
        """dX of every row (when ``need_dx``) and each ``gate_up`` slice's dW (where
        ``wanted``), in reverse."""
        d_rows = torch.empty_like(x_rows) if need_dx else None
        for j in reversed(range(self.groups)):
            self._slice_backward(self.units[j], uses[j], j, route, d_pre, x_rows, d_rows, wanted[j])
        return d_rows

    def _slice_backward(self, unit, use, j: int, route: Route, d_y, x, d_x, wanted: bool) -> None:
        """For the experts of group ``j`` with ``y = x @ W_e^T``: ``d_x = d_y @ W_e`` (when
        given) and ``dW_e = d_y^T @ x`` into the slice's gradient buffer (when ``wanted``)."""
        sched = self.scheduler
        sched.pre_backward(use)
        grads, accumulate = self.slice_grads(unit, wanted)
        weight = unit.views[0]
        for local, e in enumerate(self._experts_of(j)):
            r0, r1 = route.bounds[e]
            if d_x is not None and r1 > r0:
                torch.mm(d_y[r0:r1], weight[local], out=d_x[r0:r1])
            if grads is None:
                continue
            dw = grads[0][local]  # in the reduction's dtype
            if r1 == r0:
                if not accumulate:
                    dw.zero_()  # an expert no row reached: a zero gradient
                continue
            product = torch.mm(d_y[r0:r1].t(), x[r0:r1])
            dw.add_(product) if accumulate else dw.copy_(product)
        sched.post_backward(use, None)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        # decided here: inside Function.forward grad mode is always off
        expects_backward = torch.is_grad_enabled() and (hidden_states.requires_grad or top_k_weights.requires_grad
                                                         or any(s.requires_grad for s in self.flat_shards))
        return _SplitExpertsFn.apply(hidden_states, top_k_index, top_k_weights, expects_backward, self,
                                     *self.shard_inputs())

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden_size}, g={self.g} ({self.groups} groups x 2 phases)"

"""The shared base of split matmuls: ``Y = X @ W^T + b`` with ``W`` cut into ``g``
slices along one axis, each slice its own shard unit.

A subclass says only how its module stores the weight (the *layout adapter*) and which
axis it cuts:

- ``cut = "in"``: along the input features K: ``Y = sum_i X[:, k_i] @ W[:, k_i]^T + b``;
  slice 0 also owns the bias (added once);
- ``cut = "out"``: along the output features N: ``Y[:, n_i] = X @ W[n_i, :]^T + b[n_i]``;
  each slice owns its rows of ``W``; slice 0 owns the whole bias (kept whole so that the
  weight is the one parameter cut: [Note: split parameters] in
  osdp/runtime/split_params.py), copied when it is gathered for the later slices;
- ``transposed``: the module stores ``W^T`` ([K, N], Hugging Face ``Conv1D``), so the
  Linear-layout view of a slice is a transpose (a stride swap, never a copy).

[Note: split matmul schedule]
Forward, slice by slice in order 0..g-1: acquire the slice (all-gathered, ahead of use
within the prefetch window), add its product into ONE fp32 buffer (``cut="in"``: the
whole output accumulates; ``cut="out"``: the slice's column block of it), release it (a
zdp slice is freed right away, a dp slice is kept for backward). The output is cast to
the input's dtype once, at the end. Only X is saved for backward; a slice of X (or of
dY) is a strided view, never a copy.
Backward walks the slices in reverse (the order the scheduler prefetches in): acquire
(gather again if zdp), the slice's part of dX (``cut="in"``: its column block;
``cut="out"``: added into an fp32 dX accumulator, cast once), dW written straight into
the unit's unsharded gradient buffer (through a transposed view where the layout needs
it), release (reduce-scatter issued asynchronously, weights freed). All products go
through ``osdp.ops.kernels`` (Triton on CUDA, torch references otherwise).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import ClassVar

import torch
import torch.nn as nn

from ..errors import OSDPError
from . import kernels
from .kernels import accumulator_dtype
from .registry import SplitModule, split_sizes


class _SplitMatmulFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, expects_backward: bool, module: "MatmulSplit", *shards):
        x2 = x.reshape(-1, module.in_features)
        out = module.new_output(x2)

        def product(i, weight, bias, n0):
            module.forward_slice(out, x2, weight, bias, i)

        ctx.module, ctx.uses = module, module.forward_slices(product, expects_backward)
        # x is read again only for the weights' gradient: a frozen split op keeps no more
        # than the frozen Linear it replaces, whose autograd saves no input ([Note: frozen
        # units] in the cost model: describe measured that); dX needs x's shape alone
        ctx.x_shape, ctx.x2_spec = x.shape, (x2.shape, x2.dtype, x2.device)
        ctx.save_for_backward(x if any(s.requires_grad for s in shards) else None)
        return out.to(x.dtype).view(*x.shape[:-1], module.out_features)

    @staticmethod
    def backward(ctx, dy):
        module = ctx.module
        (x,) = ctx.saved_tensors
        x2 = None if x is None else x.reshape(-1, module.in_features)  # frozen: no dW reads it
        dy2 = dy.reshape(-1, module.out_features)
        need_dx = ctx.needs_input_grad[0]
        if need_dx:
            module.refuse_create_graph()
        dx = module.new_input_grad(*ctx.x2_spec) if need_dx else None

        def grads_of(i, weight, grads, accumulate, n0):
            module.backward_slice(dy2, x2, weight, dx, grads, accumulate, i)

        module.backward_slices(ctx.uses, grads_of, module.wanted_grads(ctx))
        if need_dx:
            dx = dx.to(ctx.x2_spec[1]).view(ctx.x_shape)  # no copy for the K-split (written in x's dtype)
        return (dx, None, None) + (None,) * module.g


def _bias_grad(dy_cols: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    if not accumulate and out.dtype == dy_cols.dtype:
        torch.sum(dy_cols, 0, out=out)  # straight into the gradient buffer
        return
    db = dy_cols.sum(0)
    out.add_(db) if accumulate else out.copy_(db)


class MatmulSplit(SplitModule):
    """Base of split matmuls; subclasses set the class attributes below."""

    cut: ClassVar[str]  # "in" or "out": the axis of the Linear-layout weight [N, K] cut
    transposed: ClassVar[bool] = False  # the module stores W^T ([K, N])
    kernels = ("addmm_slice_", "slice_dx", "slice_dw")

    def __init__(self, module: nn.Module, g: int):
        super().__init__(g)
        self.out_features, self.in_features = self.linear_shape(module)
        self.has_bias = getattr(module, "bias", None) is not None
        self.sizes = split_sizes(self.axis_length(module), g)
        self.offsets = [sum(self.sizes[:i]) for i in range(g)]

    # ---- the layout adapter ---------------------------------------------------------------
    @classmethod
    def linear_view(cls, weight: torch.Tensor) -> torch.Tensor:
        """The stored weight (or a slice, or its gradient) in Linear layout [N, K]."""
        return weight.t() if cls.transposed else weight

    @classmethod
    def linear_shape(cls, module: nn.Module) -> tuple[int, int]:
        """(N, K): output and input features."""
        return tuple(cls.linear_view(module.weight).shape)

    @classmethod
    def stored_dim(cls) -> int:
        """The dim of the STORED weight that the cut runs along."""
        linear_dim = 1 if cls.cut == "in" else 0
        return 1 - linear_dim if cls.transposed else linear_dim

    @classmethod
    def axis_length(cls, module: nn.Module) -> int:
        n, k = cls.linear_shape(module)
        return k if cls.cut == "in" else n

    # ---- the math of one slice (the autograd Function and the profiler run these) -----
    def new_output(self, x2: torch.Tensor) -> torch.Tensor:
        """The fp32 accumulator of the output."""
        shape, dev = (x2.shape[0], self.out_features), x2.device
        acc = accumulator_dtype(x2.dtype)
        return torch.zeros(shape, dtype=acc, device=dev) if self.cut == "in" else torch.empty(
            shape, dtype=acc, device=dev)

    def forward_slice(self, out, x2, weight, bias, i: int) -> None:
        """Add slice ``i``'s product into ``out`` (``weight``: Linear layout)."""
        if self.cut == "in":
            kernels.addmm_slice_(out, x2, weight, self.offsets[i], bias)
        else:
            block = out.narrow(1, self.offsets[i], self.sizes[i]).zero_()
            kernels.addmm_slice_(block, x2, weight, 0, bias)

    def new_input_grad(self, shape, dtype: torch.dtype, device) -> torch.Tensor:
        """dX of a 2-D input ``shape`` in ``dtype``: written block by block in that dtype
        (K-split) or an fp32 accumulator."""
        if self.cut == "in":
            return torch.empty(shape, dtype=dtype, device=device)
        return torch.zeros(shape, dtype=accumulator_dtype(dtype), device=device)

    def backward_slice(self, dy2, x2, weight, dx, grads, accumulate: bool, i: int) -> None:
        """Slice ``i``'s part of dX (when ``dx`` is given) and its dW (and db) into
        ``grads`` (its unsharded gradient views; None: frozen)."""
        k0, ks = self.offsets[i], self.sizes[i]
        cut_in = self.cut == "in"
        if dx is not None:
            if cut_in:
                kernels.slice_dx(dy2, weight, dx, k0)
            else:  # dX += dY[:, n_i] @ W_i
                kernels.addmm_slice_(dx, dy2, weight.t(), k0)
        if grads is None:
            return
        dw = self.linear_view(grads[0])  # [N or ns, K or ks], a view
        if cut_in:  # dW_i = dY^T @ X[:, k_i]
            kernels.slice_dw(dy2, x2, k0, ks, out=dw, accumulate=accumulate)
        else:  # dW_i^T = X^T @ dY[:, n_i]
            kernels.slice_dw(x2, dy2, k0, ks, out=dw.t(), accumulate=accumulate)
        if self.has_bias and i == 0:  # slice 0 owns the whole bias
            _bias_grad(dy2, grads[1], accumulate)

    @classmethod
    def timed_step(cls, x2: torch.Tensor, weight: torch.Tensor, dy2: torch.Tensor, g: int) -> None:
        """Forward and backward of the product split in ``g`` slices on plain tensors
        (``weight`` [N, K], Linear layout): what the profiler times for split efficiency."""
        # a stand-in module holding the weight as the op's module type stores it, so the
        # op's own constructor and layout adapter cut it
        stand_in = SimpleNamespace(weight=cls.linear_view(weight), bias=None)
        op = cls(stand_in, g)
        stored = [s["weight"] for s in cls.slice_tensors(stand_in, g)]
        out = op.new_output(x2)
        for i, w in enumerate(stored):
            op.forward_slice(out, x2, cls.linear_view(w), None, i)
        out.to(x2.dtype)
        dx = op.new_input_grad(x2.shape, x2.dtype, x2.device)
        for i in reversed(range(g)):
            op.backward_slice(dy2, x2, cls.linear_view(stored[i]), dx, [torch.empty_like(stored[i])], False, i)

    # ---- the slice loop: the acquire/release protocol, open to per-slice consumers --------
    def forward_slices(self, fn, expects_backward: bool) -> list:
        """For each slice ``i`` in order 0..g-1: acquire it (all-gathered; later slices
        prefetched within the window), call ``fn(i, weight, bias, n0)``, release it (a
        zdp slice is freed now, a dp slice kept for backward). ``weight`` is the slice in
        Linear layout ([ns_i, K] for ``cut="out"``: logits block ``x @ weight.T`` is
        columns ``n0 .. n0 + ns_i`` of the output), ``bias`` its part of the bias or
        None, ``n0 = offsets[i]``. Returns the uses: hand them to :meth:`backward_slices`
        from the consumer's autograd backward. The op's own forward is one consumer; a
        fused head + loss is another (it never builds the whole output)."""
        sched, uses, bias = self.scheduler, [], None
        for i, unit in enumerate(self.units):
            use = sched.pre_forward(unit)
            if i == 0 and self.has_bias and self.cut == "out":
                bias = unit.views[1].clone()  # slice 0's, the later slices' blocks of it too
            fn(i, self.slice_weight(unit, i), self.slice_bias(unit, i, bias), self.offsets[i])
            sched.post_forward(use, expects_backward, self.needs_weights_in_backward)
            uses.append(use)
        return uses

    def backward_slices(self, uses: list, fn, wanted: list[bool] | None = None) -> None:
        """For each slice in reverse order (the order backward prefetches in): acquire
        it again (gathered if it was freed), call ``fn(i, weight, grads, accumulate, n0)``,
        release it (its reduce-scatter is issued when this was its last use: for a slice
        tied to an embedding, the lookup's backward comes later and adds its part
        first). ``grads``: views of the slice's unsharded gradient buffer, one per slot
        (``grads[0]`` the weight in STORED layout, ``linear_view`` gives Linear
        layout), or None when frozen or not ``wanted`` this pass (a consumer whose
        Function takes :meth:`shard_inputs` passes :meth:`wanted_grads`; None: every
        trainable slice's, [Note: weight gradients a backward wants] in registry.py);
        ``accumulate``: they already hold a gradient (add to it) or not (overwrite every
        element)."""
        sched = self.scheduler
        for i in reversed(range(self.g)):
            unit, use = self.units[i], uses[i]
            sched.pre_backward(use)
            grads, accumulate = self.slice_grads(unit, unit.requires_grad if wanted is None else wanted[i])
            fn(i, self.slice_weight(unit, i), grads, accumulate, self.offsets[i])
            sched.post_backward(use, None)

    def slice_weight(self, unit, i: int) -> torch.Tensor:
        return self.linear_view(unit.views[0])

    def slice_bias(self, unit, i: int, whole: torch.Tensor | None = None) -> torch.Tensor | None:
        """Slice ``i``'s part of the bias: all of it (``cut="in"``, added once by slice 0)
        or its block of ``whole``, the copy of slice 0's (``cut="out"``)."""
        if not self.has_bias:
            return None
        if self.cut == "out":
            return whole.narrow(0, self.offsets[i], self.sizes[i])
        return unit.views[1] if i == 0 else None

    # ---- SplitModule ------------------------------------------------------------------------
    @classmethod
    def check(cls, module: nn.Module, g: int, name: str) -> None:
        length = cls.axis_length(module)
        if not 1 <= g <= length:
            raise OSDPError(
                f"cannot split {name!r} ({type(module).__name__}, {cls.axis}={length}) into {g} slices: "
                f"use 1 <= g <= {length}"
            )

    @classmethod
    def slice_tensors(cls, module: nn.Module, g: int) -> list[dict[str, torch.Tensor]]:
        weight, dim = module.weight.detach(), cls.stored_dim()
        bias = module.bias.detach() if getattr(module, "bias", None) is not None else None
        result, k0 = [], 0
        for i, ks in enumerate(split_sizes(cls.axis_length(module), g)):
            tensors = {"weight": weight.narrow(dim, k0, ks)}
            if bias is not None and i == 0:
                tensors["bias"] = bias
            result.append(tensors)
            k0 += ks
        return result

    @classmethod
    def merge(cls, slices: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        merged = {"weight": torch.cat([s["weight"] for s in slices], dim=cls.stored_dim())}
        if "bias" in slices[0]:
            merged["bias"] = slices[0]["bias"]
        return merged

    def compiled_forward(self, slice_views, x: torch.Tensor) -> torch.Tensor:
        """The op on the compiled path ([Note: compiled units] in osdp/runtime/compiled.py):
        plain differentiable torch, slice by slice, ``slice_views(i)`` gathering slice
        ``i`` (``attr -> tensor``, stored layout) where it is used. The K-split adds the
        slices' products (each in the compute dtype) in fp32 and casts once; the N-split
        concatenates the slices' column blocks."""
        x2 = x.reshape(-1, self.in_features)
        if self.cut == "in":
            out = None
            for i in range(self.g):
                views = slice_views(i)
                part = x2.narrow(1, self.offsets[i], self.sizes[i]) @ self.linear_view(views["weight"]).t()
                acc = accumulator_dtype(part.dtype)
                out = part.to(acc) if out is None else out + part.to(acc)
                if i == 0 and self.has_bias:
                    out = out + views["bias"].to(acc)
            out = out.to(x.dtype)
        else:
            blocks, bias = [], None
            for i in range(self.g):
                views = slice_views(i)
                if i == 0 and self.has_bias:
                    bias = views["bias"]
                block = x2 @ self.linear_view(views["weight"]).t()
                if bias is not None:
                    block = block + bias.narrow(0, self.offsets[i], self.sizes[i])
                blocks.append(block)
            out = torch.cat(blocks, dim=1)
        return out.view(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # decided here: inside Function.forward grad mode is always off
        expects_backward = torch.is_grad_enabled() and (
            x.requires_grad or any(s.requires_grad for s in self.flat_shards))
        device = x.device.type
        if torch.is_autocast_enabled(device) and x.is_floating_point():
            # as autocast runs nn.Linear: x in its dtype, the output too (the slices'
            # products still add up in the fp32 accumulator); the in-place kernels
            # inside are not autocast's, so the cast is here (autograd casts dX back)
            x = x.to(torch.get_autocast_dtype(device))
        return _SplitMatmulFn.apply(x, expects_backward, self, *self.shard_inputs())

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, g={self.g} along {self.axis}, "
            f"bias={self.has_bias}"
        )

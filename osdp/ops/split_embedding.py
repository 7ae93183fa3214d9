"""nn.Embedding split by rows (the vocabulary): slice ``i`` owns rows
``[r_i, r_i + rs_i)``. Each looked-up index belongs to exactly one slice, so a slice's
forward writes the rows of the output whose index falls in its range, and its backward
scatter-adds the matching rows of dY into its weight gradient. Backward reads no
weights: every slice use is released with ``needs_weights=False`` (never gathered for
backward, never kept by a ``dp`` slice for this use).

A tied embedding (its weight is also an LM head's, ``lm_head.weight is wte.weight``)
shares these slice units with the head, which runs ``tied_use_op`` on the same row
slices; see [Note: tied row split] in ``osdp/contract.py``.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import OSDPError
from .registry import SplitModule, register_split_op, split_sizes


def _check_indices(flat_idx: torch.Tensor, num_embeddings: int) -> None:
    """nn.Embedding's contract: an index outside ``[0, num_embeddings)`` is an error (a
    row no slice owns would otherwise be left unwritten). On CUDA the check runs on the
    device, like torch's own kernel, so it costs no host sync."""
    if flat_idx.numel() == 0:
        return
    in_range = (flat_idx.min() >= 0) & (flat_idx.max() < num_embeddings)
    if flat_idx.is_cuda:
        torch._assert_async(in_range, "index out of range in SplitEmbedding")
    elif not bool(in_range):
        bad = flat_idx[(flat_idx < 0) | (flat_idx >= num_embeddings)][0].item()
        raise IndexError(f"index {bad} is out of range for an embedding of {num_embeddings} rows (0..{num_embeddings - 1})")


class _SplitEmbeddingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, idx, expects_backward: bool, module: "SplitEmbedding", *shards):
        sched = module.scheduler
        flat_idx = idx.reshape(-1)
        _check_indices(flat_idx, module.num_embeddings)
        # the gathered (compute) dtype: param_dtype under mixed precision
        weight_dtype = module.units[0].views[0].dtype
        out = torch.empty(flat_idx.numel(), module.embedding_dim, dtype=weight_dtype, device=shards[0].device)
        uses = []
        for i, unit in enumerate(module.units):
            use = sched.pre_forward(unit)
            r0 = module.offsets[i]
            mask = (flat_idx >= r0) & (flat_idx < r0 + module.sizes[i])
            out[mask] = unit.views[0][flat_idx[mask] - r0]
            sched.post_forward(use, expects_backward, needs_weights=False)
            uses.append(use)
        ctx.module, ctx.uses = module, uses
        ctx.save_for_backward(idx)
        return out.view(*idx.shape, module.embedding_dim)

    @staticmethod
    def backward(ctx, dy):
        module, uses = ctx.module, ctx.uses
        sched = module.scheduler
        (idx,) = ctx.saved_tensors
        flat_idx = idx.reshape(-1)
        dy2 = dy.reshape(-1, module.embedding_dim)
        if module.padding_idx is not None:  # nn.Embedding: no gradient for the padding row
            dy2 = dy2.masked_fill((flat_idx == module.padding_idx).unsqueeze(1), 0)
        wanted = module.wanted_grads(ctx)
        for i in reversed(range(module.g)):
            unit, use = module.units[i], uses[i]
            # rows do not need the weights for backward: no gather, only a gradient
            if wanted[i]:
                r0 = module.offsets[i]
                mask = (flat_idx >= r0) & (flat_idx < r0 + module.sizes[i])
                grads, accumulate = module.slice_grads(unit, True)
                if not accumulate:
                    grads[0].zero_()
                grads[0].index_add_(0, flat_idx[mask] - r0, dy2[mask].to(grads[0].dtype))
            sched.post_backward(use, None)
        return (None, None, None) + (None,) * module.g


@register_split_op
class SplitEmbedding(SplitModule):
    """nn.Embedding cut into ``g`` slices of rows (uneven sizes allowed).

    What the planner reads (see [Note: split op declaration]): ``axis = "rows"``,
    ``axis_length`` = ``num_embeddings``, ``needs_weights_in_backward = False`` (the
    lookup's backward only scatters dY rows), ``tied_use_op`` = the op a tied head runs
    on the same slices (``linear_out_features``, ``needs_weights_in_backward = True``).
    ``planned`` stays False until the cost model prices a row split.
    """

    module_type = nn.Embedding
    op_name = "embedding_rows"
    axis = "rows"
    kernels = ()  # index_select / index_add_ in torch
    planned = True  # priced by its declaration: a gather per slice in forward only
    needs_weights_in_backward = False
    # a Linear tied to the split weight (an LM head: logits = x @ W^T) cuts the same
    # rows as its out_features, slice for slice; its backward needs the weights
    tied_use_op = "linear_out_features"

    @classmethod
    def axis_length(cls, module: nn.Embedding) -> int:
        return module.num_embeddings

    def __init__(self, module: nn.Embedding, g: int):
        super().__init__(g)
        self.num_embeddings = module.num_embeddings
        self.embedding_dim = module.embedding_dim
        self.padding_idx = module.padding_idx
        self.sizes = split_sizes(module.num_embeddings, g)
        self.offsets = [sum(self.sizes[:i]) for i in range(g)]

    @classmethod
    def check(cls, module: nn.Embedding, g: int, name: str) -> None:
        if not 1 <= g <= module.num_embeddings:
            raise OSDPError(
                f"cannot split {name!r} (Embedding, num_embeddings={module.num_embeddings}) into "
                f"{g} slices: use 1 <= g <= {module.num_embeddings}"
            )
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise OSDPError(
                f"cannot split {name!r}: max_norm, scale_grad_by_freq and sparse embeddings "
                "are not supported by the row split; leave it unsplit"
            )

    @classmethod
    def slice_tensors(cls, module: nn.Embedding, g: int) -> list[dict[str, torch.Tensor]]:
        weight, result, r0 = module.weight.detach(), [], 0
        for rs in split_sizes(module.num_embeddings, g):
            result.append({"weight": weight[r0 : r0 + rs]})
            r0 += rs
        return result

    @classmethod
    def merge(cls, slices: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {"weight": torch.cat([s["weight"] for s in slices], dim=0)}

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # decided here: inside Function.forward grad mode is always off
        expects_backward = torch.is_grad_enabled() and any(s.requires_grad for s in self.flat_shards)
        return _SplitEmbeddingFn.apply(idx, expects_backward, self, *self.shard_inputs())

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, g={self.g}"

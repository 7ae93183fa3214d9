"""Bytes of one op's weights and activations as the plan holds them: at rest (the
model's dtype), gathered (param_dtype), reduced (reduce_dtype), saved activations in the
compute dtype, and a vocabulary head's logits (docs/design/cost_model.md's [Note: memory
model] and [Note: fused vocabulary-split loss]), and which of them train ([Note: frozen
units]).

[Note: frozen units]
A unit whose parameters do not train (``requires_grad`` off when described:
``OpDesc.trainable``; a unit trains or is frozen as one, runtime/trainable.py) still
holds its shard and is gathered for its forward, but has no gradient: no gradient
buffer, reduce-scatter or all-reduce, sharded gradient, optimizer state or optimizer
temporaries, and autograd computes no dW for it (its backward, when it has one, is the
input's gradient: half a trained matmul's where no profile measured it). A frozen unit
that nothing trained feeds (``OpDesc.in_backward`` False: a frozen backbone's prefix) has
no backward at all: the runtime sees no gradient reach its output and frees its weights
after the forward whatever its mode (dp keeps nothing), gathers nothing for it in
backward and its activations were never saved (describe measured none). The profiler
stamps a unit's backward by its gradient: a frozen unit's backward time falls to the
trained unit whose gradient comes next, so the step's total is kept. Every term
reads ``trained_params``/``trained_tensors`` or ``backward_needs_weights``. Before this,
a stock Llama with all but ``lm_head`` frozen was priced as fully trained (2 gloo ranks:
500 kB predicted, 164 kB measured).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..model_desc import ModelDesc, OpDesc

if TYPE_CHECKING:  # annotations only: settings.py imports this module
    from .settings import PlannerSettings


def element_bytes(op: OpDesc) -> float:
    """Bytes per parameter at rest (the model's own dtype: the master copy)."""
    return op.param_bytes / op.param_count if op.param_count else 0.0


def trained_params(op: OpDesc) -> int:
    """Parameters of the unit that train: all of them, or none for a frozen unit."""
    return op.param_count if op.trainable else 0


def trained_tensors(op: OpDesc) -> tuple[int, ...]:
    """Elements per parameter tensor the optimizer steps (none for a frozen unit)."""
    return op.tensors if op.trainable else ()


def gathered_bytes(op: OpDesc, settings: PlannerSettings) -> float:
    """Bytes of the unit's full weights as gathered and computed with."""
    if settings.param_dtype_bytes is None or not op.param_count:
        return float(op.param_bytes)
    return float(op.param_count * settings.param_dtype_bytes)


def reduced_bytes(op: OpDesc, settings: PlannerSettings) -> float:
    """Bytes of the unit's full gradient as reduce-scattered (0 when it is frozen)."""
    return float(trained_params(op) * (settings.reduce_dtype_bytes or element_bytes(op)))


def activation_scale(desc: ModelDesc, settings: PlannerSettings) -> float:
    """Saved activations shrink with the compute dtype (the description was measured in
    the model's own dtype)."""
    if settings.param_dtype_bytes is None:
        return 1.0
    counted = [op for op in desc.ops if op.param_count]
    model_bytes = sum(op.param_bytes for op in counted) / max(sum(op.param_count for op in counted), 1)
    return settings.param_dtype_bytes / model_bytes if model_bytes else 1.0


def fused_logits_bytes(desc: ModelDesc, i: int) -> float:
    """Logits bytes per sample that a vocabulary-split option of op ``i`` never holds
    ([Note: fused vocabulary-split loss]); 0 unless op ``i`` is the model's last op (the
    saved logits are then seen by no later op, so the saving is an option's own term)."""
    op = desc.ops[i]
    if i != len(desc.ops) - 1 or op.logits_bytes_per_sample <= 0:
        return 0.0
    return float(min(op.logits_bytes_per_sample, op.act_bytes_per_sample))

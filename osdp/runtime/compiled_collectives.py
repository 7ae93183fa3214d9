"""The compiled path's collectives (differentiable gathers; replicated gradients are
compiled_rep_grads.py's) and the names its gathers give the shard group, which say
what a checkpoint keeps and keep alike gathers apart ([Note: compiled units] in
compiled.py)."""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.utils.checkpoint import CheckpointPolicy

from .compiled_prefetch import _ALL_GATHER
from .mesh import group_over_ranks_of
from .mixed_precision import average_factors

_C10D = torch.ops._c10d_functional
# a dp unit's gathers name the shard group by this alias, so that a checkpointed
# block's policy can tell them (saved) from zdp gathers (recomputed)
_KEPT_SUFFIX = ":osdp-kept"
# each zdp gather of a graph after its first names the shard group by this suffix plus
# its index ([Note: a unit used twice in one graph])
_CALL_SUFFIX = ":osdp-call"


# ---- the collectives, differentiable ---------------------------------------------------------
class GatherShard(torch.autograd.Function):
    """This rank's flat shard (master dtype) -> the gathered flat buffer (compute
    dtype). Backward: the gradient in the reduce dtype, reduce-scattered (sum) over the
    shard group, averaged, in the master dtype."""

    @staticmethod
    def forward(ctx, flat, world: int, group_name: str, compute_dtype, reduce_dtype, rank_if_all_reduce=None):
        ctx.world, ctx.group_name, ctx.reduce_dtype, ctx.master_dtype = world, group_name, reduce_dtype, flat.dtype
        ctx.rank_if_all_reduce = rank_if_all_reduce
        return _C10D.wait_tensor(_C10D.all_gather_into_tensor(flat.to(compute_dtype), world, group_name))

    @staticmethod
    def backward(ctx, grad):
        pre, post = average_factors(ctx.world, ctx.reduce_dtype)  # [Note: fp16 gradient average]
        grad = grad.to(ctx.reduce_dtype).contiguous()
        if pre != 1:
            grad = grad / pre
        if ctx.rank_if_all_reduce is not None:  # [Note: gloo reduce-scatter]
            total = _C10D.wait_tensor(_C10D.all_reduce(grad, "sum", ctx.group_name))
            n = total.numel() // ctx.world
            shard = total.narrow(0, ctx.rank_if_all_reduce * n, n)
        else:
            shard = _C10D.wait_tensor(_C10D.reduce_scatter_tensor(grad, "sum", ctx.world, ctx.group_name))
        return (shard / post).to(ctx.master_dtype), None, None, None, None, None


class ReplicaGrad(torch.autograd.Function):
    """A ``rep`` unit's flat parameters (master dtype) -> its compute copy; backward:
    the gradient all-reduced (sum, in the reduce dtype) and averaged over the ranks
    (``group_name`` None: the local gradient, left to :class:`ReplicaGradBucket`)."""

    @staticmethod
    def forward(ctx, flat, world: int, group_name, compute_dtype, reduce_dtype):
        ctx.world, ctx.group_name, ctx.reduce_dtype, ctx.master_dtype = world, group_name, reduce_dtype, flat.dtype
        return flat.to(compute_dtype) if compute_dtype != flat.dtype else flat.view_as(flat)

    @staticmethod
    def backward(ctx, grad):
        if ctx.group_name is None:
            return grad.to(ctx.master_dtype), None, None, None, None
        pre, post = average_factors(ctx.world, ctx.reduce_dtype)  # [Note: fp16 gradient average]
        grad = grad.to(ctx.reduce_dtype).contiguous()
        if pre != 1:
            grad = grad / pre
        total = _C10D.wait_tensor(_C10D.all_reduce(grad, "sum", ctx.group_name))
        return (total / post).to(ctx.master_dtype), None, None, None, None


def recompute_gathers_policy(ctx, func, *args, **kwargs):
    """A ``zdp`` gather's region: everything in it (the shard's rebuild, the cast, the
    all-gather) runs again for backward; nothing of it is saved."""
    return CheckpointPolicy.MUST_RECOMPUTE


def checkpointed_block_policy(ctx, func, *args, **kwargs):
    """A checkpointed block: everything recomputed for backward except the gathers of
    ``dp`` units (their gathered buffers are kept, as eagerly)."""
    if func is _ALL_GATHER:
        kept = isinstance(args[2], str) and args[2].endswith(_KEPT_SUFFIX)
        return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_RECOMPUTE


# [Note: compiled collective timeouts]
# Eager OSDP bounds each wait on a collective by ``timeout_s`` (collectives.py). A
# compiled graph's ``wait_tensor`` takes no timeout: the backend bounds it by the
# process group's own, fixed when the group was made (gloo's default 30 min, NCCL's
# 10 min). So a compiled step whose peer died or runs something else (a generate loop
# one rank left early) waited half an hour where eager OSDP raised after 300 s. The
# compiled path gathers and reduces on a group of its own over the same ranks, made
# with ``timeout_s``: the user's group keeps its own timeout (a checkpoint barrier may
# need hours), which setting its default (``_set_pg_timeout``, torchtitan's way after
# its first step) would have cut for every collective of theirs. Its cost is one more
# communicator: a few sockets on gloo; on NCCL, buffers on each GPU (unmeasured here).
_TIMED_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def timed_group(group, timeout_s: float):
    """A process group over ``group``'s ranks and backend whose collectives time out
    after ``timeout_s`` ([Note: compiled collective timeouts]); ``group`` itself where
    nothing can hang (one rank) or the backend is not one OSDP made a group of (a fake
    or custom process group). Collective over ``group``: every member calls it alike."""
    backend = str(dist.get_backend(group))
    if group.size() == 1 or not ("gloo" in backend or "nccl" in backend):
        return group
    made = _TIMED_GROUPS.setdefault(group, {})
    if timeout_s not in made:
        made[timeout_s] = group_over_ranks_of(group, backend=backend, timeout_s=timeout_s)
    return made[timeout_s]


def kept_group_name(group) -> str:
    """The name ``dp`` gathers use for ``group``: an alias of the same process group,
    registered once (no new communicator)."""
    return group_alias(group, _KEPT_SUFFIX)


# [Note: a unit used twice in one graph]
# A unit's module may compute more than once in one forward: a tied weight's unit (a GPT's
# wte, also its head) in two modules, a module called twice (ALBERT's shared layer, a
# block looped over). In one graph (the whole model, or a block at scope="blocks") the
# gathers of a zdp unit for those calls were the same functional collective of the same
# inputs, and AOT autograd's common-subexpression pass merged them: one gather, its
# buffer held from the first call to the last, where the plan (and eager OSDP) gathers
# for each call and frees in between. Measured: HF ALBERT (one layer at 4 depths), 14
# forward gathers where eager OSDP's ledger counts 38; the tied case of
# test_compiled.py, 13 where the plan has 14; a Linear called twice, 3 forward and 2
# backward gathers where the plan has 4 and 3. So
# the zdp gathers of one graph name the shard group each by a name of its own: the n-th
# zdp gather dynamo traces in a graph by the group's n-th alias
# (:func:`traced_gather_name`, run by dynamo while tracing, its result a constant of
# the graph; :func:`group_alias`), and common-subexpression elimination finds no two
# alike. A dp unit's calls share one gather: eagerly it stays gathered. The count reads
# nothing of the unit (alike blocks keep sharing their code, [Note: one code object per
# region plan]); the aliases number at most the zdp gathers of one graph, and ranks need
# not agree on them (an alias is the same communicator).
def group_alias(group, suffix: str) -> str:
    """``group``'s name plus ``suffix``, registered as another name of the same process
    group (no new communicator)."""
    name = group.group_name + suffix
    try:
        registered = c10d._resolve_process_group(name)
    except (RuntimeError, ValueError, KeyError):
        registered = None
    if registered is not group:  # none yet, or left by a destroyed group of that name
        if registered is not None:
            c10d._unregister_process_group(name)
        c10d._register_process_group(name, group)
    return name


# the trace under way (a weak reference to its tracing context) and the zdp gathers
# named in it so far ([Note: a unit used twice in one graph])
_traced_gathers: list = [lambda: None, 0]


@torch._dynamo.assume_constant_result
def traced_gather_name(group_name: str) -> str:
    """The group name of the next zdp gather in the graph dynamo is tracing: run by
    dynamo at trace time (its result a constant of the graph), not by the compiled graph
    ([Note: a unit used twice in one graph]). The count starts again with each trace
    (its own tracing context); it reads nothing of the unit, so alike blocks keep
    sharing their code."""
    trace = torch._guards.TracingContext.try_get()
    if trace is None or _traced_gathers[0]() is not trace:
        _traced_gathers[:] = [weakref.ref(trace) if trace is not None else lambda: None, 0]
    count = _traced_gathers[1]
    _traced_gathers[1] = count + 1
    return group_alias(c10d._resolve_process_group(group_name), f"{_CALL_SUFFIX}{count}") if count else group_name

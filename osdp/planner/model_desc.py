"""Model description: the ordered operator units the planner decides on, and measuring
them on the tensors given (``describe_tensors``; ``osdp.planner.description.describe`` is
the public entry, which picks fake tensors for a meta model).

``describe_tensors(model, example_inputs)`` measures a forward on this process (saved
activations through saved-tensor hooks, FLOPs through ``FlopCounterMode``, with the
grouped matmul of MoE experts counted: [Note: grouped matmul] in grouped_mm.py).
``describe_gpt(config)`` builds the same description analytically, so models far larger
than this machine can be planned. Both return a ``ModelDesc``.

[Note: attributing work to units]
A unit is a leaf module that owns parameters, in the order its forward first runs.
Work done outside any unit (attention scores, GELU, residual adds) belongs to the unit
that ran last before it: its memory and time live and die with that unit's place in
the schedule. Saved tensors are counted once per storage (a tensor saved by two ops is
one allocation) and parameters are never counted as activations.

[Note: backward transients]
During a unit's backward more is alive than the saved activations of the units up to it:
the incoming gradient, the gradients it produces, temporaries of the attributed
non-parameter ops (a softmax backward holds two score-sized tensors). describe measures
it: a real backward runs under a live-bytes tracker, and for each unit the peak inside
its backward interval (from the previous unit's gradient to its own, as the profiler
times it) minus the parameters, the gradients so far and the saved activations of the
units up to it is that unit's transient. Two batch sizes separate the per-sample part.

[Note: the loss's moment]
The loss's forward and its backward up to the gradient of the last unit's output are an
interval of their own, ``ModelDesc.loss_bytes_per_sample`` (beyond every saved
activation: a cross-entropy's log-probabilities and the gradients it makes, beside the
held logits). In the last unit's interval, as it was, one line fitted through batches 1
and 2 took the head's dW (a constant) for the larger moment and the loss's (three
logits-sized tensors a sample) went unpriced at larger batches: a stock Llama with only
its head training (vocabulary 4096, batch 8, 2 ranks) measured 45.0 MiB in the
log-softmax backward against 39.0 predicted (+15%); all of it training, 93.1 against
91.4. The cost model prices it as the last op's loss moment ([Note: fused
vocabulary-split loss]). A model that fuses its loss into the split head keeps its loss in
the head's interval: the cost model prices that loss by formula, from its logits.

[Note: the vocabulary head]
The last unit to run, when it is an ``nn.Linear`` whose out_features equal the rows of
an ``nn.Embedding`` of the model (tied to it or not), is the vocabulary head: it is cut
along its output features (the registered planned Linear op with that axis), and its
output bytes per sample are its ``logits_bytes_per_sample`` when the described forward
saved at least that much for it (the loss ran in the forward) and the model fuses its
loss into the split head ([Note: fused head loss] in osdp/contract.py), so that the cost model
counts what a fused vocabulary-split loss saves. A tied use splits only along its
owner's axis (rows of the same weight); else neither use splits.
"""
from __future__ import annotations

import hashlib
import json
import weakref
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten

from ..contract import fuses_head_loss
from ..errors import OSDPError
from ..memtrack import IntervalPeakTracker, storage_key
from ..module_tree import leaf_paths, transformer_blocks, unit_params
from ..ops import registered_split_ops, split_op_of
from . import grouped_mm
from .inputs import ExampleInputs, LossFn, as_example_inputs, batch_loss


@dataclass(frozen=True)
class OpDesc:
    """One operator unit. Bytes are per device for the unsharded (gathered) weights."""

    name: str  # module path, e.g. "blocks.0.mlp.c_fc"
    kind: str  # lower-case module class: linear, embedding, layernorm, conv1d, ...
    param_count: int  # parameters owned by this unit (0 for a tied second use)
    param_bytes: int  # bytes of those parameters in the dtype they are gathered in
    act_bytes_per_sample: float  # activation bytes saved for backward, per sample
    flops_per_sample: float  # forward FLOPs per sample
    splittable: bool  # the planner may split it (with ``split_op``)
    in_features: int = 0  # length of the axis ``split_op`` cuts (0 if not splittable)
    block: str | None = None  # checkpointable block this unit belongs to
    tied_to: str | None = None  # owner unit when this op reuses another unit's weights
    # transient bytes of its backward beyond the saved activations (gradients of
    # activations in flight), per sample; see [Note: backward transients]
    act_grad_bytes_per_sample: float = 0.0
    split_op: str = ""  # the registered split op (osdp.ops) it would be split with
    # the model's vocabulary head (the last unit, its output the logits the loss reads):
    # bytes per sample of those logits, which a vocabulary-split option computes slice by
    # slice with a fused loss and never saves; 0 for every other unit. See the cost
    # model's [Note: fused vocabulary-split loss]
    logits_bytes_per_sample: float = 0.0
    # parameter tensors owned (the optimizer keeps per-tensor state too: AdamW's step)
    param_tensors: int = 0
    # elements of each of those tensors, in registration order (the optimizer's order);
    # () for one tensor of param_count, or unknown. The cost model's [Note: optimizer
    # step moment] reads it (a for-loop AdamW's temporaries follow the tensors)
    tensor_numels: tuple = ()
    # of ``act_bytes_per_sample``, the bytes that are its block's input (a LayerNorm
    # first in a transformer block saves the block's input): a checkpointed block keeps
    # that tensor as its input already, so its recompute does not add it again ([Note:
    # checkpointed block input] in the cost model)
    block_input_bytes_per_sample: float = 0.0
    # its parameters train (requires_grad when described): only a trained unit has a
    # gradient, optimizer state and a reduction ([Note: frozen units] in the cost model)
    trainable: bool = True
    # backward runs through it (its output needed a gradient in the described forward):
    # False only for a frozen unit that nothing trained feeds (a frozen backbone's
    # prefix), which neither computes nor gathers anything in backward
    in_backward: bool = True

    def __post_init__(self):
        if self.trainable and not self.in_backward:
            raise OSDPError(f"unit {self.name!r} trains but is not in backward: a unit whose parameters train "
                            "is always in backward (in_backward=True)")
        numels = tuple(int(n) for n in self.tensor_numels)
        if numels and sum(numels) != self.param_count:
            raise OSDPError(f"unit {self.name!r}: tensor_numels {list(numels)} add up to {sum(numels)}, not to its "
                            f"param_count {self.param_count}; list the elements of each parameter tensor it owns")
        # one canonical form (a JSON list becomes a tuple; one tensor of param_count is ())
        object.__setattr__(self, "tensor_numels", () if len(numels) <= 1 else numels)

    @property
    def tensors(self) -> tuple[int, ...]:
        """Elements per parameter tensor (one of param_count when not described)."""
        return self.tensor_numels or ((self.param_count,) if self.param_count else ())

    @property
    def max_slices(self) -> int:
        return self.in_features if self.splittable else 1


@dataclass(frozen=True)
class BlockDesc:
    """A checkpointable block: a contiguous run of units."""

    name: str
    first_op: int
    num_ops: int
    input_bytes_per_sample: float  # what checkpointing keeps: the block's input


@dataclass(frozen=True)
class ModelDesc:
    name: str
    ops: tuple[OpDesc, ...]
    blocks: tuple[BlockDesc, ...] = ()
    act_constant_bytes: float = 0.0  # saved bytes independent of the batch (masks, ...)
    # bytes per sample the model's output holds once backward is over (the logits a
    # loop's ``out`` keeps, a returned cache): [Note: the held output]
    output_bytes_per_sample: float = 0.0
    # bytes per sample the loss's moment holds beyond every saved activation, until its
    # backward reaches the last unit's output: [Note: the loss's moment]
    loss_bytes_per_sample: float = 0.0
    # the model's buffers (every rank holds them whole: causal masks, position tables)
    buffer_bytes: float = 0.0
    # work not attributed to a unit of its own, counted in totals for reference
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if not self.ops:
            raise OSDPError(
                f"model {self.name!r} has no parameters: there is nothing to shard or plan"
            )
        names = [op.name for op in self.ops]
        if len(set(names)) != len(names):
            raise OSDPError(f"model {self.name!r} lists a unit twice: unit names must be unique")
        for op in self.ops:
            if op.param_count < 0 or op.param_bytes < 0 or op.act_bytes_per_sample < 0:
                raise OSDPError(f"unit {op.name!r} has a negative size; sizes must be >= 0")

    @property
    def param_count(self) -> int:
        return sum(op.param_count for op in self.ops)

    @property
    def param_bytes(self) -> int:
        return sum(op.param_bytes for op in self.ops)

    def op_index(self, name: str) -> int:
        for i, op in enumerate(self.ops):
            if op.name == name:
                return i
        raise KeyError(f"no unit named {name!r} in model {self.name!r}")

    def fingerprint(self) -> str:
        """Identity of the model's structure: unit names, kinds and sizes in order, and
        the frozen units when some are. Plans carry it so that they are only used with
        this model (a fully trainable model's is the same as before units could be
        frozen)."""
        parts = [(op.name, op.kind, op.param_count, op.tied_to) for op in self.ops]
        frozen = [op.name for op in self.ops if not op.trainable]
        if frozen:  # a plan priced for frozen units does not hold when they train
            parts.append(("frozen", frozen))
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "ops": [_op_dict(op) for op in self.ops],
            "blocks": [asdict(b) for b in self.blocks],
            "act_constant_bytes": self.act_constant_bytes,
            "output_bytes_per_sample": self.output_bytes_per_sample,
            "loss_bytes_per_sample": self.loss_bytes_per_sample,
            "buffer_bytes": self.buffer_bytes,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "ModelDesc":
        return cls(
            name=data["name"],
            ops=tuple(OpDesc(**op) for op in data["ops"]),
            blocks=tuple(BlockDesc(**b) for b in data.get("blocks", ())),
            act_constant_bytes=float(data.get("act_constant_bytes", 0.0)),
            output_bytes_per_sample=float(data.get("output_bytes_per_sample", 0.0)),
            loss_bytes_per_sample=float(data.get("loss_bytes_per_sample", 0.0)),
            buffer_bytes=float(data.get("buffer_bytes", 0.0)),
        )


def _op_dict(op: OpDesc) -> dict:
    """An op's JSON form; a trained op's is as before ops could be frozen (caches keyed by
    a description keep their keys)."""
    data = asdict(op)
    for name in ("trainable", "in_backward"):
        if data[name]:
            del data[name]
    return data


def module_kind(module: nn.Module) -> str:
    return type(module).__name__.lower()


def _split_axis(module: nn.Module) -> tuple[str, int]:
    """The split op the planner may use for ``module`` and the length of the axis it
    cuts, from the registry (``osdp.ops``); ("", 0) if none. Ops the cost model cannot
    price yet (``planned = False``) are left out."""
    op = split_op_of(module)
    if op is None or not op.planned:
        return "", 0
    return op.op_name, op.axis_length(module)


def vocab_split_op(module_type: type):
    """The registered, planned split op that cuts ``module_type`` along its output
    features, the one a vocabulary head is split with (the vocabulary is the head's
    output axis: its rows, as in the embedding it may be tied to); None if there is none."""
    for op in registered_split_ops().values():
        if op.module_type is module_type and op.axis == "out_features" and op.planned:
            return op
    return None


def _vocab_head(order: list[str], by_path: dict) -> str | None:
    """[Note: the vocabulary head] The last unit to run, when it is a Linear whose output
    width is the row count of an Embedding of the model (tied to it or not): the logits
    the loss reads. None otherwise."""
    if not order:
        return None
    last = by_path[order[-1]]
    rows = {m.num_embeddings for m in by_path.values() if isinstance(m, nn.Embedding)}
    if isinstance(last, nn.Linear) and last.out_features in rows and vocab_split_op(type(last)) is not None:
        return order[-1]
    return None


class _Saved:
    """One storage saved for backward: the unit it is attributed to (None: before the
    first unit), its bytes, whether it is that unit's block input, and the saved tensors
    on it (weakly: see [Note: saved and still alive])."""

    def __init__(self, unit: str | None, nbytes: int, block_input: bool):
        self.unit, self.nbytes, self.block_input = unit, nbytes, block_input
        self.tensors: list[weakref.ref] = []

    def alive(self) -> bool:
        return any(ref() is not None for ref in self.tensors)


class _Recorder:
    """Hooks that attribute saved tensors to the unit that is running.

    [Note: saved and still alive]
    What a forward saves for backward is counted when the forward ends, among the saved
    tensors still alive then: a branch whose output no later op reads (a router's
    top-k of group scores that only its indices leave) frees its graph node, and the
    tensors that node saved, during the forward. Counted when saved, they were priced as
    held through backward; and a later storage allocated where a freed one was took its
    identity (``storage_key`` is the storage's address) and went uncounted, so that
    describe on real tensors gave another figure each run (a DeepSeek-V3 experts unit:
    2320 to 8768 bytes a sample over four calls, 9600 on fake tensors)."""

    def __init__(self, units: dict[nn.Module, str], param_ptrs: set[int]):
        self.units = units
        self.param_ptrs = param_ptrs
        self.order: list[str] = []
        self.storages: dict[int, _Saved] = {}  # storage_key -> the storage saved there last
        self.current: str | None = None
        # storage -> the blocks it is the input of (one tensor may enter several: a
        # pass-through bridge between blocks, then the next block)
        self.block_inputs: dict[int, set[str]] = {}
        self.in_backward: set[str] = set()  # units whose output needed a gradient

    def pre_hook(self, module, _inputs):
        name = self.units[module]
        if name not in self.order:
            self.order.append(name)
        self.current = name

    def post_hook(self, module, _inputs, output):
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(output)[0]):
            self.in_backward.add(self.units[module])

    def pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        ptr = storage_key(tensor)
        if ptr in self.param_ptrs or not storage.nbytes():
            return tensor
        saved = self.storages.get(ptr)
        if saved is None or not saved.alive():  # new, or a freed one's address reused
            block_input = (self.current is not None
                           and _enclosing_block(self.current, self.block_inputs.get(ptr, ())) is not None)
            saved = self.storages[ptr] = _Saved(self.current, storage.nbytes(), block_input)
        # the node holds an alias: the tensor itself (an op's own output) would hold the
        # node that holds it, a cycle only the garbage collector frees, and a dead branch
        # would stay alive to the count
        packed = tensor.detach()
        saved.tensors.append(weakref.ref(packed))
        return packed

    def totals(self) -> tuple[dict[str, int], int, dict[str, int]]:
        """Per unit, the bytes it saved that are still alive (call it while the forward's
        output is); the bytes saved before the first unit; per unit, those of them that
        are its block's input."""
        saved: dict[str, int] = {}
        input_saved: dict[str, int] = {}
        pending = 0
        for entry in self.storages.values():
            if not entry.alive():
                continue
            if entry.unit is None:
                pending += entry.nbytes
                continue
            saved[entry.unit] = saved.get(entry.unit, 0) + entry.nbytes
            if entry.block_input:
                input_saved[entry.unit] = input_saved.get(entry.unit, 0) + entry.nbytes
        return saved, pending, input_saved


def _measure_forward(model, inputs: ExampleInputs, units, param_ptrs, blocks):
    """One forward pass: unit order, saved bytes per unit, block input bytes, FLOPs, and
    per unit the bytes of its block's input among what it saved."""
    from torch.utils.flop_counter import FlopCounterMode

    rec = _Recorder(units, param_ptrs)
    block_inputs: dict[str, int] = {}
    handles = [m.register_forward_pre_hook(rec.pre_hook) for m in units]
    handles += [m.register_forward_hook(rec.post_hook) for m in units]
    modules = dict(model.named_modules())
    for block in blocks:

        def block_hook(_m, args, block=block):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            block_inputs.setdefault(block, sum(t.numel() * t.element_size() for t in tensors))
            for t in tensors:
                rec.block_inputs.setdefault(storage_key(t), set()).add(block)

        handles.append(modules[block].register_forward_pre_hook(block_hook))
    try:
        with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
            with FlopCounterMode(display=False, custom_mapping=grouped_mm.flop_formulas()) as counter:
                output = inputs.call(model)
        saved, pending, input_saved = rec.totals()  # while the output holds the graph
        del output
    finally:
        for h in handles:
            h.remove()
    if rec.order:
        first = rec.order[0]
        saved[first] = saved.get(first, 0) + pending
    return rec.order, saved, block_inputs, counter.get_flop_counts(), input_saved, rec.in_backward


def _measure_backward(model, inputs: ExampleInputs, order: list[str], saved: dict[str, int],
                      loss, own_params: dict[str, list[nn.Parameter]], leaves=()) -> dict[str, float]:
    """Per unit, bytes alive at the peak of its backward beyond parameters, gradients and
    the saved activations of the units up to it (see [Note: backward transients]).
    ``loss``: the model's output -> the scalar whose backward runs; ``own_params``: per
    unit, the parameters it owns (a tied weight: its first unit's). Also the bytes still
    alive once backward is over beside the parameters, their gradients, the buffers and
    the inputs: what the output holds ([Note: the held output])."""
    params = list(model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)

    def grad_bytes():
        return sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)

    tracker = IntervalPeakTracker(params, extra=grad_bytes)
    done: set[int] = set()

    def head_backward_starts(_grad):  # the loss's backward has made the last unit's output's gradient
        if tracker.interval == _LOSS:
            tracker.interval = order[-1]

    def hook_head_output(_module, _args, out):
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(head_backward_starts)

    # a model fusing its loss into the split head has that moment priced by formula ([Note:
    # fused vocabulary-split loss]): its loss stays in the head's interval
    fused = fuses_head_loss(model)
    handles = [] if fused else [model.get_submodule(order[-1]).register_forward_hook(hook_head_output)]
    try:
        with tracker:
            output = inputs.call(model)
            # [Note: the loss's moment]: its forward and its backward up to the last
            # unit's output gradient, an interval of its own
            tracker.interval = order[-1] if fused else _LOSS
            value = loss(output)
            del output  # the loss holds it (hold_output), as a loop's `out` does
            # a unit's backward ends with its first parameter's gradient; a leaf's with
            # the last of those this graph gives one (an expert no token reached gets none)
            in_graph = _params_in_graph(value) if leaves else set()
            ends = {}
            for i, name in enumerate(order):
                own = [p for p in own_params.get(name, ()) if p.requires_grad]
                ends[i] = [p for p in own if id(p) in in_graph] if name in leaves else own[:1]
            hooked = [i for i in ends if ends[i]]
            left = {i: len(ends[i]) for i in hooked}

            def hook(_p, i):
                # a tied weight accumulates once per use: only the last one (every later
                # unit done) ends this unit's interval
                left[i] -= 1
                if i not in done and left[i] <= 0 and all(j in done for j in hooked if j > i):
                    done.add(i)
                    tracker.interval = order[i - 1] if i else None

            for i in hooked:
                handles += [p.register_post_accumulate_grad_hook(lambda p, i=i: hook(p, i)) for p in ends[i]]
            value.backward()
            tracker.interval = None
            grad_tensors = [p.grad for p in params if p.grad is not None]
            held = tracker.live_bytes_except([*params, *grad_tensors, *model.buffers(), *inputs.tensors(), value])
            # the buffers an op read are followed too: the model's, priced apart (buffer_bytes)
            followed_buffers = tracker.live_bytes_except([]) - tracker.live_bytes_except(list(model.buffers()))
            del value
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    if order[-1] not in tracker.peaks and _LOSS in tracker.peaks:  # no gradient reached the last unit's output
        tracker.peaks[order[-1]] = tracker.peaks.pop(_LOSS)
    result, prefix = {}, 0
    for name in order:
        prefix += saved.get(name, 0)
        peak, grads = tracker.peaks.get(name, (0, 0))
        result[name] = max(peak - param_bytes - grads - prefix, 0) if peak else 0
    peak, grads = tracker.peaks.get(_LOSS, (0, 0))
    loss_bytes = max(peak - param_bytes - grads - prefix - followed_buffers, 0) if peak else 0
    return result, held, loss_bytes


_LOSS = object()  # the loss's interval in _measure_backward (no unit's name)


def _units_that_never_ran(ran: list[str], units: list[str], tied: dict[str, str],
                          own_params: dict[str, list]) -> tuple[dict[str, str], list[str]]:
    """[Note: units that never ran] A unit owning parameters need not run: T5's (and
    every Hugging Face encoder-decoder's) ``shared`` embedding is read only through the
    encoder's and decoder's own embeddings tied to it, and a model may hold a module it
    never calls (an unused pooler). The runtime still holds such a unit's shards and
    optimizer states, and gathers the owner's unit wherever a tied use runs. So:

    - the first use to run of an owner that never ran stands for the owner: its op
      takes the owner's name (the unit the runtime gathers there) and parameters, and is
      no tied use any more (``renames``: use -> owner); a use with parameters of its own
      cannot take another name, and the owner comes just before it, with no work;
    - a unit that neither ran nor had a use run comes with no work after the last unit
      that ran inside its nearest enclosing module (last of all when none did): priced
      for its parameters, its states and a gather it never needs (on the safe side), and
      inside its block, which stays one contiguous run of ops (an unused module in a
      layer left the block in two pieces, refused as "cannot be checkpointed").

    Returns ``(renames, order)``, the units' order with those names."""
    renames: dict[str, str] = {}
    order: list[str] = []
    placed = set(ran)
    for path in ran:
        owner = tied.get(path)
        if owner is not None and owner not in placed:
            placed.add(owner)
            order.append(owner)
            if not own_params.get(path):
                renames[path] = owner
                continue
        order.append(path)
    for path in units:
        if path not in placed and own_params.get(path):
            order.insert(_after_its_enclosing_module(order, path), path)
    return renames, order


def _after_its_enclosing_module(order: list[str], path: str) -> int:
    """Where in ``order`` the unit ``path`` goes: after the last unit inside its nearest
    enclosing module that has one, or at the end."""
    parts = path.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:depth]) + "."
        inside = [i for i, other in enumerate(order) if other.startswith(prefix)]
        if inside:
            return inside[-1] + 1
    return len(order)


def _renamed(values: dict, renames: dict[str, str]) -> dict:
    return {renames.get(key, key): value for key, value in values.items()}


def _params_in_graph(output: torch.Tensor) -> set[int]:
    """ids of the parameters whose gradients ``output.backward()`` will accumulate."""
    found: set[int] = set()
    seen: set = set()
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node
        if variable is not None:
            found.add(id(variable))
        stack.extend(fn for fn, _ in node.next_functions)
    return found


def _attribute_flops(flop_counts, root_name: str, unit_names, order) -> dict[str, float]:
    """FLOPs per unit: a unit's own, plus the residual FLOPs of every enclosing module
    (its total minus its children's) given to its first unit in execution order."""
    totals = {}
    for key, ops in flop_counts.items():
        if key == "Global":
            continue
        path = key[len(root_name) + 1 :] if key != root_name else ""
        totals[path] = float(sum(ops.values()))
    result = {name: totals.get(name, 0.0) for name in unit_names}
    rank = {name: i for i, name in enumerate(order)}
    for path, total in totals.items():
        if path in result:
            continue
        prefix = f"{path}." if path else ""
        inner = [p for p in totals if p.startswith(prefix) and p != path]
        # direct children among the modules that ran (a ModuleList never runs itself)
        children = [p for p in inner if not any(p.startswith(q + ".") for q in inner)]
        residual = total - sum(totals[c] for c in children)
        inside = [u for u in unit_names if u.startswith(prefix) and u in rank]
        if residual > 0 and inside:
            result[min(inside, key=rank.__getitem__)] += residual
    return result


def describe_tensors(
    model: nn.Module,
    example_inputs,
    *,
    name: str | None = None,
    blocks: list[str] | None = None,
    batch_size: int | None = None,
    measure_backward: bool = True,
    loss_fn: LossFn | None = None,
    leaf_modules=None,
) -> ModelDesc:
    """``osdp.planner.description.describe`` on the tensors as they are (real, or fake
    under a ``FakeTensorMode``); the arguments are ``describe``'s, which picks fake
    tensors for a meta model."""
    inputs = as_example_inputs(example_inputs)
    tensors = inputs.tensors()
    if batch_size is None:
        batch_size = inputs.batch_size()
    if batch_size <= 0:
        raise OSDPError(f"example batch size must be positive, got {batch_size}")

    leaves = leaf_paths(model, leaf_modules, defaults=True)  # as OSDP resolves them by hand
    units: dict[nn.Module, str] = {}
    owner_of: dict[int, str] = {}  # id(param) -> first unit that owns it
    tied: dict[str, str] = {}
    unit_tensors: dict[str, list[nn.Parameter]] = {}  # per unit, every parameter it computes with, once
    for path, module, params in unit_params(model, leaves):
        units[module] = path
        unit_tensors[path] = list({id(p): p for *_, p in params}.values())
        for p in unit_tensors[path]:
            if id(p) in owner_of:
                tied.setdefault(path, owner_of[id(p)])
            else:
                owner_of[id(p)] = path
    own_params = {path: [p for p in ps if owner_of[id(p)] == path] for path, ps in unit_tensors.items()}
    if not units:
        raise OSDPError(f"{type(model).__name__} has no parameters: there is nothing to shard or plan")
    # what the model holds, not its activations: a saved view of a buffer (a causal mask's
    # slice) is the buffer, which ModelDesc.buffer_bytes counts
    param_ptrs = {storage_key(t) for t in (*model.parameters(), *model.buffers())}
    block_names = transformer_blocks(model) if blocks is None else list(blocks)
    block_names = [b for b in block_names if not any(b.startswith(leaf + ".") for leaf in leaves)]
    known = dict(model.named_modules())
    for block in block_names:
        if block not in known:
            raise OSDPError(f"block {block!r} is not a module path of the model")

    was_training = model.training
    model.train()
    by_path = {path: module for module, path in units.items()}
    head_out: list[int] = []  # bytes of each output of the candidate heads, first forward
    head_hooks = [m.register_forward_hook(lambda _m, _a, out: head_out.append(out.numel() * out.element_size()))
                  for m in by_path.values() if isinstance(m, nn.Linear)]
    try:
        try:
            ran, saved, block_in, flops, input_saved, in_backward = _measure_forward(
                model, inputs, units, param_ptrs, block_names)
        finally:
            for h in head_hooks:
                h.remove()
        unit_flops = _attribute_flops(flops, type(model).__name__, list(ran), ran)
        renames, order = _units_that_never_ran(ran, list(units.values()), tied, own_params)
        saved, input_saved, unit_flops = (_renamed(d, renames) for d in (saved, input_saved, unit_flops))
        in_backward = {renames.get(path, path) for path in in_backward}
        for use in renames:
            del tied[use]  # it stands for its owner now
        half = batch_size // 2
        # the user's at_batch makes real tensors: not on a fake description's
        resizable = inputs.at_batch is not None and not any(isinstance(t, FakeTensor) for t in tensors)
        if half >= 1 and (resizable or all(t.dim() > 0 and t.shape[0] == batch_size for t in tensors)):
            small = inputs.with_batch(half)  # fresh storage: a view would count the full batch's
            _, saved_half, _, _, _, _ = _measure_forward(model, small, units, param_ptrs, [])
            saved_half = _renamed(saved_half, renames)
        else:
            half, small, saved_half = 0, None, {}
        grads_full = grads_half = {}
        held_full = held_half = loss_full = loss_half = 0
        if measure_backward:
            grads_full, held_full, loss_full = _measure_backward(
                model, inputs, order, saved, lambda out: batch_loss(out, loss_fn, batch_size, batch_size),
                own_params, leaves)
            if half:
                grads_half, held_half, loss_half = _measure_backward(
                    model, small, order, saved_half, lambda out: batch_loss(out, loss_fn, half, batch_size),
                    own_params, leaves)
    finally:
        model.train(was_training)

    def split_batch(full: dict, halved: dict):
        """Two points: bytes = constant + per_sample * batch (one point: all per sample)."""
        per_sample, constant = {}, 0.0
        for unit in order:
            value = full.get(unit, 0)
            if half:
                slope = max((value - halved.get(unit, 0)) / (batch_size - half), 0.0)
                per_sample[unit] = slope
                constant += max(value - slope * batch_size, 0.0)
            else:
                per_sample[unit] = value / batch_size
        return per_sample, constant

    per_sample, constant = split_batch(saved, saved_half)
    grad_per_sample, _ = split_batch(grads_full, grads_half)
    # [Note: the held output]: what grows with the batch (a batch-independent part, if
    # any, is within the constant the loss scalars and the device's constant price)
    held_per_sample, loss_per_sample = ((max((full - halved) / (batch_size - half), 0.0) if half else full / batch_size)
                                        for full, halved in ((held_full, held_half), (loss_full, loss_half)))
    # the loss's batch-independent part (its targets shifted, a reduction's temporaries) is
    # priced with the constant activations: every moment pays it, the loss's included
    constant += max(loss_full - loss_per_sample * batch_size, 0.0)

    ops = []
    head = _vocab_head(order, by_path)
    # the head's logits: its last output in the forward (the Linear hooks ran in order)
    # only a model whose loss runs through the split head's fused cross-entropy never
    # holds them ([Note: fused head loss] in osdp/contract.py)
    fused_loss = fuses_head_loss(model)
    logits = head_out[-1] / batch_size if head is not None and head_out and fused_loss else 0.0
    axes = {}
    for path in order:
        module = by_path[path]
        axes[path] = _split_axis(module)
        if path == head:
            op = vocab_split_op(type(module))
            axes[path] = (op.op_name, op.axis_length(module))
        if path in leaves:
            axes[path] = ("", 0)  # gathered whole ([Note: leaf modules])
    for path, owner in tied.items():
        if path not in axes:
            continue  # a tied use that never ran: no op of its own
        # a tied use is split with its owner's slicing ([Note: tied weights] in the cost
        # model): only when its own op cuts the owner's axis (rows of the same weight)
        # and it computes with nothing but that weight (the runtime's rule: a module
        # with a bias of its own, or weights of two owners, cannot follow the slices);
        # otherwise neither use splits
        pure = all(owner_of[id(p)] == owner for p in unit_tensors[path])
        if not pure or not axes[owner][0] or axes[path][1] != axes[owner][1]:
            axes[path] = axes[owner] = ("", 0)
    for path in order:
        module = by_path[path]
        own = own_params[path]
        split_op, axis = axes[path]
        splittable = axis >= 2
        # a tied use trains as its owner does: it computes with the owner's weights
        trainable = any(p.requires_grad for p in unit_tensors[path])
        ops.append(
            OpDesc(
                name=path,
                kind=module_kind(module),
                param_count=sum(p.numel() for p in own),
                param_bytes=sum(p.numel() * p.element_size() for p in own),
                act_bytes_per_sample=per_sample.get(path, 0.0),
                flops_per_sample=unit_flops.get(path, 0.0) / batch_size,
                splittable=splittable,
                in_features=axis if splittable else 0,
                block=_enclosing_block(path, block_names),
                tied_to=tied.get(path),
                act_grad_bytes_per_sample=grad_per_sample.get(path, 0.0),
                split_op=split_op if splittable else "",
                # what a vocabulary split never holds: the logits, when the described
                # forward saved them (its loss ran); see [Note: the vocabulary head]
                logits_bytes_per_sample=logits if logits and path == head and splittable
                and per_sample.get(path, 0.0) >= logits else 0.0,
                param_tensors=len(own),
                tensor_numels=tuple(p.numel() for p in own),
                # a block's input grows with the batch (no constant part)
                block_input_bytes_per_sample=min(input_saved.get(path, 0) / batch_size, per_sample.get(path, 0.0)),
                trainable=trainable,
                in_backward=trainable or path in in_backward,
            )
        )
    block_descs = _block_descs(ops, block_names, {b: v / batch_size for b, v in block_in.items()})
    return ModelDesc(
        name=name or type(model).__name__,
        ops=tuple(ops),
        blocks=block_descs,
        act_constant_bytes=constant,
        output_bytes_per_sample=held_per_sample,
        loss_bytes_per_sample=loss_per_sample,
    )


def _enclosing_block(path: str, blocks: list[str]) -> str | None:
    for block in blocks:
        if path == block or path.startswith(block + "."):
            return block
    return None


def _block_descs(ops, block_names, input_bytes_per_sample) -> tuple[BlockDesc, ...]:
    result = []
    for block in block_names:
        idx = [i for i, op in enumerate(ops) if op.block == block]
        if not idx:
            continue
        if idx != list(range(idx[0], idx[-1] + 1)):
            raise OSDPError(f"block {block!r} does not run as one contiguous piece; it cannot be checkpointed")
        result.append(BlockDesc(block, idx[0], len(idx), input_bytes_per_sample.get(block, 0.0)))
    return tuple(sorted(result, key=lambda b: b.first_op))


def with_dtype(desc: ModelDesc, param_bytes_per_element: int) -> ModelDesc:
    """The same model with weights gathered in another dtype (e.g. 2 for bf16)."""
    return replace(
        desc,
        ops=tuple(replace(op, param_bytes=op.param_count * param_bytes_per_element) for op in desc.ops),
    )

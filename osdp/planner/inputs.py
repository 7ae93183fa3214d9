"""Example inputs of one forward and the loss of its output: what describe, the profiler
and auto mode run (``osdp.planner.describe``, ``osdp.profiler.profile``, ``osdp.auto_plan``,
``osdp.OSDP(model, memory_limit=..., example_inputs=...)``).

[Note: example inputs and the loss]
``example_inputs`` is one of

- a tuple (or list) of positional arguments: ``model(*example_inputs)``;
- a dict of keyword arguments: ``model(**example_inputs)``; the way to drive a
  Hugging Face model (``{"input_ids": x, "labels": y}``: a second positional argument
  of ``GPT2LMHeadModel.forward`` is ``past_key_values``, not the labels);
- ``ExampleInputs(args, kwargs)`` when a forward needs both;
- a single tensor: ``model(tensor)``.

The batch is dim 0 of the first tensor (positional arguments first, then keyword
arguments in their order; inside an argument that is a dict, list or tuple, its tensors
in order: ``model(batch)`` with ``batch = {"image": x, "label": y}`` is
``example_inputs=(batch,)``). describe halves the batch and the profiler repeats or cuts
it: every tensor whose dim 0 equals the batch, in containers too, is cut or repeated
along dim 0; other values (flags such as ``use_cache=False``, tensors of another leading
size) are passed as they are. Inputs whose samples do not sit along dim 0 (a
vision-language model's packed image patches: Qwen2-VL's ``pixel_values`` are
``(patches of every image, features)``, its ``image_grid_thw`` one row per image) cannot
be cut that way: ``ExampleInputs(args, kwargs, at_batch=fn)`` gives ``fn(n)``, the inputs
of ``n`` samples (any of the forms above), which the profiler uses for every other batch
size. Without it, a run at another batch that fails with a tensor left as it was says
which tensors and to give ``at_batch``.

The loss whose backward describe and the profiler run (and measure) is, in order:

1. ``loss_fn(output)`` when given; it must return a scalar tensor and must work for any
   batch (it sees the outputs of the halved and repeated batches too): take the targets
   from the output (Hugging Face: ``labels=`` in the inputs, then ``.loss``), not from
   a closure over the example batch;
2. ``output.loss`` (a Hugging Face ``ModelOutput``) or ``output["loss"]`` (a dict) when
   it is a tensor;
3. a tensor output: itself when it is a scalar, else ``output.float().sum()`` (a
   stand-in loss with the same backward cost).

A tuple, or a dict / ``ModelOutput`` without a loss, needs ``loss_fn`` (auto mode
excepted, below, for one with class-dimension ``logits``): the error says so.

Whatever the rule, the output is held as long as the loss (``hold_output``: its values
other than the loss, kept on the loss's autograd node), because a training loop holds it:
``out = model(**batch); out.loss.backward(); optim.step()`` (Hugging Face's own examples)
or ``logits = model(x)`` keep the output's tensors through backward and the optimizer
step. ``model(...).loss`` alone drops them once the loss is computed, and the runtime's
measurement of a plan (``osdp.profiler.measure_plan``; auto mode picks by it, with no
margin below the limit: [Note: measured choice]) ran that way, so a loop holding the
output went over by exactly the output. A stock Llama (6 layers, hidden 512, GQA 8/4,
intermediate 1536, vocabulary 8192), 2 gloo ranks, batch 4 x 64, 318.8 MiB: the pick
measured 317.92 MiB, in the loop that holds the output 325.92 (+8 MiB, the fp32 logits:
MemoryLimitExceeded). The runtime's tracker and an independent count of every storage an
operator produces or receives agreed within 0.03 MiB there and on 7 other plans: the
tracker was right, the step it measured was not the loop's. Measured held, three picks
peaked at 318.19, 275.17 and 316.67 MiB in that loop (8 MiB less in one that drops the
output): a plan is conservative by at most the output for such a loop. After backward
the cost model adds what describe measured the output to hold ([Note: the held output]
in osdp/planner/cost_model/end_of_backward.py).

Auto mode (``osdp.auto_plan``, ``osdp.OSDP(model, memory_limit=..., example_inputs=...)``)
plans for the memory of a step, and a training loop adds to the output what rule 3 leaves
out: the sum's gradient is a broadcast scalar (no bytes), while a loss over logits saves
its log-probabilities and, in backward, makes their gradient and the logits' (three tensors
as big as the output, beside the held output). Planned for the sum, a tied 3-layer
Transformer at 24 MiB (``torch.testing``'s test Transformer, vocabulary 101, 2 ranks) was
predicted at 23.89 MiB and its loop's ``cross_entropy`` measured 24.75 MiB. So when no
``loss_fn`` is given, auto mode runs :class:`AssumedLoss` instead of rule 3 for an output
with a class dimension (a floating tensor of 2 or more dimensions whose last one is at
least 2): a cross-entropy over the last dimension against example targets (class 0
everywhere: the bytes and the work of a cross-entropy do not depend on the targets), in
fp32 as Hugging Face's losses compute it; likewise over the ``logits`` of a dict or
``ModelOutput`` without a loss (a Hugging Face model called without ``labels=``, whose
loop computes its own loss from ``out.logits``: a meta-built model has no real targets for
a ``loss_fn`` to close over). Rules 1 and 2 and the other outputs are unchanged. Rank 0
logs the assumption once (a warning of logger ``osdp.auto``), the plan keeps it
(``Plan.assumed_loss``) and a step over the memory limit names ``loss_fn=`` as the fix
(``osdp/runtime/peak.py``). ``osdp.planner.describe`` and ``osdp.profiler.profile``
called directly keep rule 3.
"""
from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_leaves, tree_map

from ..errors import OSDPError
from ..module_tree import signature_or_none

LossFn = Callable[[Any], torch.Tensor]

log = logging.getLogger("osdp.auto")


class ExampleInputs(NamedTuple):
    """Positional and keyword arguments of one forward: ``model(*args, **kwargs)``;
    ``at_batch``: ``n -> the inputs of n samples``, for inputs whose samples do not sit
    along dim 0 ([Note: example inputs and the loss])."""

    args: tuple = ()
    kwargs: dict = {}
    at_batch: Callable[[int], object] | None = None
    # the tensors ``with_batch`` left as they were (named, with their shapes): what a
    # failing run at that batch names
    kept_as_given: tuple[str, ...] = ()

    def call(self, model):
        try:
            return model(*self.args, **self.kwargs)
        except Exception as exc:
            if not self.kept_as_given:
                raise
            raise OSDPError(
                f"the example inputs at batch {self.batch_size()} failed ({type(exc).__name__}: "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}); describe halves the batch and "
                f"the profiler repeats or cuts it along dim 0 of every tensor whose dim 0 is the batch, and these "
                f"were passed as given: {', '.join(self.kept_as_given)}. Where samples do not sit along dim 0 "
                "(packed image patches and their per-image grids), pass osdp.ExampleInputs(args, kwargs, "
                "at_batch=fn) with fn(n) returning the inputs of n samples"
            ) from exc

    def tensors(self) -> list[torch.Tensor]:
        """Tensor arguments, positional first, then keyword ones in their order; the
        tensors in a dict, list or tuple argument in theirs."""
        return argument_tensors(self.args, self.kwargs)

    def batch_size(self) -> int:
        """Dim 0 of the first tensor argument."""
        first = next(iter(self.tensors()), None)
        if first is None or first.dim() == 0:
            raise OSDPError(
                "example inputs need a tensor with a batch dimension (dim 0 of the first tensor "
                f"argument, or of the first tensor in a dict, list or tuple argument, is the batch); "
                f"got {describe_inputs(self)}"
            )
        return int(first.shape[0])

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "ExampleInputs":
        """The same call with ``fn`` applied to every tensor, in containers too."""
        def one(v):
            return fn(v) if isinstance(v, torch.Tensor) else v

        args, kwargs = tree_map(one, (tuple(self.args), dict(self.kwargs)))
        return self._replace(args=args, kwargs=kwargs)

    def map_batched(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "ExampleInputs":
        """The same call with ``fn`` applied to every tensor whose dim 0 is the batch."""
        batch = self.batch_size()
        return self.map_tensors(lambda t: fn(t) if t.dim() > 0 and t.shape[0] == batch else t)

    def with_batch(self, batch: int) -> "ExampleInputs":
        """The inputs cut to (or repeated up to) ``batch`` samples; fresh storage, so a
        smaller batch never counts the larger one's bytes. ``at_batch``'s, when given."""
        if self.at_batch is not None:
            made = as_example_inputs(self.at_batch(batch))
            if made.batch_size() != batch:
                raise OSDPError(f"ExampleInputs.at_batch({batch}) returned inputs of batch {made.batch_size()} "
                                f"(dim 0 of their first tensor): return {batch} samples")
            return made._replace(at_batch=self.at_batch)

        def resize(t: torch.Tensor) -> torch.Tensor:
            reps = -(-batch // t.shape[0])
            if reps > 1:
                return t.repeat(reps, *([1] * (t.dim() - 1)))[:batch].clone()
            return t[:batch].clone()

        example = self.batch_size()
        kept = tuple(f"{name} {tuple(shape)}" for name, shape in _tensor_shapes(self.args, self.kwargs).items()
                     if shape and shape[0] != example)
        return self.map_batched(resize)._replace(kept_as_given=kept if batch != example else ())


def argument_tensors(args, kwargs) -> list[torch.Tensor]:
    """The tensors of a call's arguments in order (positional, then keyword), those in a
    dict, list or tuple argument in theirs: whose first is the batch."""
    return [v for v in tree_leaves((tuple(args), dict(kwargs))) if isinstance(v, torch.Tensor)]


def forward_signature(module) -> inspect.Signature | None:
    """The signature of ``module``'s forward (None where it has none to read)."""
    return signature_or_none(module.forward)


def _named_tensors(named: dict) -> dict[str, torch.Tensor]:
    """The tensors among ``named`` values (argument name -> value), in dict, list or
    tuple values too, each named by its place (``batch.image``, ``inputs[0]``)."""
    found: dict[str, torch.Tensor] = {}

    def visit(path: str, value) -> None:
        if isinstance(value, torch.Tensor):
            found[path] = value
        elif isinstance(value, Mapping):
            for key, item in value.items():
                visit(f"{path}.{key}", item)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                visit(f"{path}[{i}]", item)

    for name, value in named.items():
        visit(name, value)
    return found


def _tensor_shapes(args, kwargs) -> dict[str, tuple[int, ...]]:
    """Every tensor of a call's arguments, named by its place (``pixel_values``,
    ``args[1]``, ``batch.image``), and its shape."""
    named = {**{f"args[{i}]": v for i, v in enumerate(args)}, **kwargs}
    return {path: tuple(t.shape) for path, t in _named_tensors(named).items()}


def sample_shapes(signature: inspect.Signature | None, args, kwargs) -> dict[str, tuple[int, ...]]:
    """Per tensor with a batch dimension among a call's arguments, named by the
    parameter of the forward's ``signature`` it binds to (``model(ids)`` and
    ``model(input_ids=ids)`` alike; its position where it cannot bind them) and its place in a dict,
    list or tuple argument (``batch.input_ids``, ``inputs[0]``), the shape of one sample:
    its shape past dim 0."""
    try:
        named = dict(signature.bind_partial(*args, **kwargs).arguments)
    except (AttributeError, TypeError):  # no signature, or one these arguments do not fit
        named = {**{str(i): v for i, v in enumerate(args)}, **kwargs}
    return {path: tuple(t.shape[1:]) for path, t in _named_tensors(named).items() if t.dim() > 0}


def as_example_inputs(example_inputs) -> ExampleInputs:
    """Normalize ``example_inputs`` (see [Note: example inputs and the loss])."""
    if isinstance(example_inputs, ExampleInputs):
        if example_inputs.at_batch is not None and not callable(example_inputs.at_batch):
            raise OSDPError(f"ExampleInputs.at_batch must be a function of the batch size returning the inputs of "
                            f"that many samples, got {example_inputs.at_batch!r}")
        return example_inputs._replace(args=tuple(example_inputs.args), kwargs=dict(example_inputs.kwargs))
    if isinstance(example_inputs, Mapping):
        bad = [k for k in example_inputs if not isinstance(k, str)]
        if bad:
            raise OSDPError(
                f"example_inputs as a dict are keyword arguments: keys must be parameter names "
                f"(str), got {bad!r}"
            )
        return ExampleInputs((), dict(example_inputs))
    if isinstance(example_inputs, (tuple, list)):
        return ExampleInputs(tuple(example_inputs), {})
    if isinstance(example_inputs, torch.Tensor):
        return ExampleInputs((example_inputs,), {})
    raise OSDPError(
        f"example_inputs must be a tuple of positional arguments, a dict of keyword arguments "
        f"(e.g. {{'input_ids': x, 'labels': y}}), osdp.ExampleInputs(args, kwargs) or one "
        f"tensor; got {type(example_inputs).__name__}"
    )


def describe_inputs(inputs: ExampleInputs) -> str:
    def one(v):
        if isinstance(v, torch.Tensor):
            return f"tensor{tuple(v.shape)}"
        if isinstance(v, Mapping):
            return "{" + ", ".join(f"{k!r}: {one(x)}" for k, x in v.items()) + "}"
        if isinstance(v, (tuple, list)):
            return type(v).__name__ + "(" + ", ".join(one(x) for x in v) + ")"
        return type(v).__name__

    parts = [one(v) for v in inputs.args] + [f"{k}={one(v)}" for k, v in inputs.kwargs.items()]
    return f"({', '.join(parts)})"


def loss_of(output, loss_fn: LossFn | None = None) -> torch.Tensor:
    """The scalar whose backward describe and the profiler run (see
    [Note: example inputs and the loss]), holding ``output`` as long as it lives
    (:func:`hold_output`)."""
    loss = _loss_of(output, loss_fn)
    hold_output(loss, output)
    return loss


_HELD = "osdp_held_output"  # the key in the loss's grad_fn.metadata


def hold_output(loss: torch.Tensor, output) -> None:
    """Keep what ``output`` holds beside ``loss`` (the logits of a ``ModelOutput``, a
    tensor output, a tuple's items) alive as long as ``loss``: a training loop's
    ``out = model(...)`` keeps them through backward and the optimizer step (see
    [Note: example inputs and the loss]). Kept on the loss's autograd node, never the
    loss itself (a cycle through the node would leak them): only values the loss was
    computed from, whose nodes lie before the loss's."""
    node = loss.grad_fn
    if node is None or output is loss:
        return
    held = [v for v in _output_values(output) if v is not loss and v is not None]
    if held:
        node.metadata[_HELD] = held


def _loss_of(output, loss_fn: LossFn | None = None) -> torch.Tensor:
    kind = type(output).__name__
    if loss_fn is not None:
        loss = loss_fn(output)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise OSDPError(f"loss_fn(output) must return a scalar tensor, got {got}")
        return loss
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else output.float().sum()
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    if isinstance(output, Mapping) or hasattr(output, "loss"):
        raise OSDPError(
            f"the model's output ({kind}) has no loss: put the targets in example_inputs "
            "(Hugging Face: {'input_ids': x, 'labels': y}) or pass loss_fn=lambda output: <scalar tensor>"
        )
    raise OSDPError(
        f"the model returned a {kind}, not a tensor or an output with a .loss: pass "
        "loss_fn=lambda output: <scalar tensor> (e.g. lambda out: out[0].float().sum())"
    )


def batch_loss(output, loss_fn: LossFn | None, batch: int, example_batch: int) -> torch.Tensor:
    """``loss_of`` for a forward of ``batch`` samples; a ``loss_fn`` that fails on a batch
    other than the example's, or on a model described on fake tensors (one built on the
    meta device), is told why: it closed over the example's targets."""
    if loss_fn is None:
        return loss_of(output)
    try:
        return loss_of(output, loss_fn)
    except OSDPError:
        raise
    except Exception as exc:
        failure = f"{type(exc).__name__}: {exc}"
        if _holds_fake_tensor(output):
            raise OSDPError(
                f"loss_fn failed on the output of a model described on fake tensors ({failure}); "
                "a model built on the meta device is described without allocating anything, so "
                "loss_fn(output) must compute from the output alone, not from tensors it closed over "
                "(take the targets from the output, e.g. labels= in the inputs and output.loss; or "
                "leave loss_fn out: a logits output is priced with a cross-entropy over its last "
                "dimension)"
            ) from exc
        if batch == example_batch:
            raise
        raise OSDPError(
            f"loss_fn failed on the output of a forward of {batch} samples ({failure}); describe "
            f"and the profiler also run batches other than example_inputs' {example_batch}: "
            "loss_fn(output) must work for any batch (take the targets from the output, e.g. "
            "labels= in the inputs and output.loss)"
        ) from exc


def _output_values(output) -> list:
    """The values of a model's output: a mapping's (a ``ModelOutput``'s), a sequence's
    items, or the output itself."""
    if isinstance(output, Mapping):
        return list(output.values())
    if isinstance(output, (tuple, list)):
        return list(output)
    return [output]


def _holds_fake_tensor(output) -> bool:
    """Whether ``output`` holds a fake tensor, as describe's outputs on a meta-built model do."""
    return any(isinstance(v, FakeTensor) for v in _output_values(output))


def has_class_dim(output) -> bool:
    """A floating tensor of 2 or more dimensions whose last one is at least 2 (logits over
    classes, the vocabulary): what :class:`AssumedLoss` prices a cross-entropy over."""
    return (isinstance(output, torch.Tensor) and output.is_floating_point() and output.dim() >= 2
            and output.shape[-1] >= 2)


class AssumedLoss:
    """The loss auto mode runs when it was given none (see [Note: example inputs and the
    loss]): ``F.cross_entropy`` over the last dimension of an output with a class
    dimension, in fp32, against class-0 targets, the output held as long as the loss;
    :func:`loss_of`'s rules for every other output. ``assumed``: what it assumed, once it
    did ("" until then); ``announce``: log that once (rank 0)."""

    def __init__(self, announce: bool = True):
        self.announce = announce
        self.assumed = ""

    def __call__(self, output) -> torch.Tensor:
        scores, what = _class_scores(output)
        if scores is None:
            return loss_of(output)
        logits = scores.float().flatten(0, -2)
        targets = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        loss = F.cross_entropy(logits, targets)
        hold_output(loss, output)  # the loop's `out = model(x)` holds it through backward
        if not self.assumed:
            classes = scores.shape[-1]
            self.assumed = (f"cross_entropy over the last dimension of {what} ({classes} classes; {what} "
                            f"{tuple(scores.shape)} {str(scores.dtype).replace('torch.', '')} held through "
                            "backward)")
            if self.announce:
                log.warning("auto mode: no loss_fn given; planning memory for %s; pass loss_fn=lambda output: "
                            "<scalar tensor> to plan for your own loss", self.assumed)
        return loss


def _class_scores(output) -> tuple[torch.Tensor | None, str]:
    """What :class:`AssumedLoss` prices a cross-entropy over, and its name: the output
    when it has a class dimension, or the ``logits`` of a mapping (a Hugging Face
    ``ModelOutput`` called without ``labels=``, its loss computed by the loop) that has
    no ``loss``; (None, "") for every other output, which :func:`loss_of` takes."""
    if has_class_dim(output):
        return output, "the output"
    if isinstance(output, Mapping) and not isinstance(output.get("loss"), torch.Tensor):
        logits = output.get("logits")
        if has_class_dim(logits):
            return logits, "the output's logits"
    return None, ""


def auto_mode_loss(loss_fn: LossFn | None, announce: bool = True) -> LossFn:
    """``loss_fn``, or the :class:`AssumedLoss` auto mode runs when it is None."""
    return loss_fn if loss_fn is not None else AssumedLoss(announce)

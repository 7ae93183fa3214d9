"""Plans auto mode measured, kept on disk so that a restarted job re-plans in seconds.

[Note: measured plan cache]
Auto mode's pick is a function of the model (its full description: units, sizes,
activations), the run (world size, node size, layout, memory limit), the machine (the
profiled device's name: processor and backend; the host; the torch version), the
planner's settings, the batch asked for, the example inputs' shapes and dtypes, the
loss function and the mixed-precision policy. A key hashing all of them names a plan
file under the profile cache's directory (``plans/<key>.json``, beside
``profile-cache.json``: ``cache_dir=``, ``$OSDP_CACHE_DIR`` or ``~/.cache/osdp``). A
fresh one (younger than the profile cache's entries may be, ``$OSDP_PROFILE_MAX_AGE_S``)
is the plan, unmeasured again; ``reprofile`` (``$OSDP_REPROFILE=1``) measures anew.
Rank 0 reads and writes; every rank gets its plan. A file that does not load is
ignored (and replaced by the next measured plan).

The plan's measurements are as load-dependent as the profile's, so the plan file
carries the profile cache's speed stamp ([Note: profile cache] in
osdp/planner/profile_cache.py): the reference matmul's rate when auto mode began
measuring, checked again when it is done. A plan measured while that speed changed
is not cached, and a cached plan is read only at its own speed.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import asdict

import torch
from torch.utils._pytree import tree_flatten

from .planner.inputs import as_example_inputs
from .planner.plan import Plan
from .planner.profile_cache import (Speed, cache_dir, default_max_age_s, gflops, reprofile_requested, speed_now,
                                    speeds_agree, steady_speed)
from .rank_agreement import decide_on_rank0, is_rank0
from .runtime import compiled_coalesce, compiled_prefetch

log = logging.getLogger("osdp.auto")
# how a compiled run chooses its plan ([Note: compiled plans] in osdp/compiled_choice.py)
# and the hashes of the code of OSDP's inductor passes its finalists ran with: part of its
# key, so that a plan chosen another way, or measured on an older compiled path, is
# measured again
COMPILED_CHOICE = "eager-calibrated, finalists compiled"


def _inputs_signature(example_inputs) -> list:
    inputs = as_example_inputs(example_inputs)
    return [[name, *_value_signature(value)]
            for name, value in [(str(i), a) for i, a in enumerate(inputs.args)] + sorted(inputs.kwargs.items())]


def _value_signature(value) -> list:
    """A tensor's shape and dtype; a container holding tensors (a batch dict), its
    structure and its leaves' signatures (never their values); anything else, its repr."""
    if isinstance(value, torch.Tensor):
        return [list(value.shape), str(value.dtype)]
    leaves, structure = tree_flatten(value)
    if any(isinstance(leaf, torch.Tensor) for leaf in leaves):
        return [str(structure), [_value_signature(leaf) for leaf in leaves]]
    return [repr(value)]


def _loss_key(loss_fn) -> str | None:
    """What names a loss across runs: the loss auto mode assumed, or the function's
    module and qualified name (never an object's address)."""
    if loss_fn is None:
        return None
    if getattr(loss_fn, "assumed", ""):
        return f"assumed: {loss_fn.assumed}"
    fn = getattr(loss_fn, "func", loss_fn)  # a functools.partial: the function it calls
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


class MeasuredPlans:
    """See [Note: measured plan cache]."""

    def __init__(self, directory=None, *, enabled: bool = True, group=None, device=None):
        """``device``: where the model computes, for the speed stamp (every rank of
        ``group`` calls :meth:`get` and :meth:`put`, which time it together)."""
        self.path = cache_dir(directory) / "plans"
        self.enabled, self.group = enabled, group
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.speed: Speed | None = None  # the machine's speed at get

    def key(self, desc, device, settings, batch, global_batch, example_inputs, loss_fn, mixed_precision,
            compile=None) -> str:
        """``compile``: the run's CompileConfig (its finalists are measured compiled,
        [Note: compiled plans] in osdp/compiled_choice.py); None (eager) keeps the keys
        eager runs had. A compiled run's key names how it chooses (COMPILED_CHOICE): the
        plans cached by the earlier way (every plan measured compiled, out of the
        budget) are not reused."""
        loss = _loss_key(loss_fn)
        parts = {
            "desc": desc.to_dict(),
            "run": [device.world_size, device.node_size, device.memory_limit_bytes],
            "machine": [device.name, platform.node(), torch.__version__],
            "settings": asdict(settings),
            "batch": [batch, global_batch],
            "inputs": _inputs_signature(example_inputs),
            "loss": loss,
            "mixed_precision": repr(mixed_precision),
        }
        if compile is not None:
            parts["compile"] = [repr(compile), COMPILED_CHOICE, compiled_prefetch.RULES_HASH,
                                compiled_coalesce.RULES_HASH]
        return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]

    def _file(self, key: str):
        return self.path / f"{key}.json"

    def get(self, key: str) -> Plan | None:
        """The cached plan of ``key`` (rank 0's, on every rank), or None: missing,
        expired, unreadable, measured at another speed of the machine than now, or
        bypassed (reprofile)."""
        if not self.enabled:
            return None
        self.speed = speed_now(self.device, self.group)

        def cached():
            if reprofile_requested():
                return None
            path = self._file(key)
            try:
                if not path.is_file() or time.time() - path.stat().st_mtime > default_max_age_s():
                    return None
                stored = json.loads(path.read_text())
                stamp = stored.get("speed_flops_per_s") if isinstance(stored, dict) else None
                if not isinstance(stamp, (int, float)) or not speeds_agree(self.speed.flops_per_s, stamp):
                    log.info("the cached plan %s was measured with the reference matmul at %s, it runs at %s "
                             "now: measuring again", path, gflops(stamp), gflops(self.speed.flops_per_s))
                    return None
                return Plan.from_dict(stored["plan"]).to_dict()
            except Exception as exc:  # a damaged file: measured again, and replaced
                log.warning("ignoring the cached plan %s (%s: %s); measuring again", path, type(exc).__name__, exc)
            return None

        found = decide_on_rank0(cached, self.group)
        return None if found is None else Plan.from_dict(found)

    def put(self, key: str, plan: Plan) -> None:
        """Cache ``plan`` (rank 0 writes; every rank calls, after :meth:`get`), unless the
        machine's speed changed while it was measured."""
        if not self.enabled:
            return
        end = speed_now(self.device, self.group)
        if not is_rank0(self.group) or not steady_speed(self.speed, end, "auto mode measured its plans"):
            return
        stored = {"speed_flops_per_s": min(self.speed.flops_per_s, end.flops_per_s), "plan": plan.to_dict()}
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            tmp = self._file(key).with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(stored, indent=1))
            os.replace(tmp, self._file(key))
        except OSError as exc:
            log.warning("could not cache the measured plan in %s (%s)", self.path, exc)

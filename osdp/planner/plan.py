"""Plan: what the planner decided, what it predicts, and how it is stored.

A plan names every unit by its module path with its slice count and per-slice modes,
the blocks to checkpoint, the batch size and prefetch window, and the predictions (step
time, samples/s, peak memory with its breakdown) beside those of FSDP full shard
(all ``zdp``), shard-grad-op (all ``dp``) and DDP (all ``rep``) at the same memory limit. Saved as
versioned JSON with the model's fingerprint, so a plan is only used with its model.

[Note: checked plan files]
A plan file may be edited by hand; ``from_dict`` checks every field it reads and names
the one that is wrong (``units[3].modes``, ``batch_size``). Each unit is stored with its
``slices`` beside its per-slice ``modes``: an edit that changes one without the other is
refused, as is a slice count above the plan's ``settings.max_slices``, and ``rep`` on a
slice of a split unit (``rep`` is for whole units: [Note: replicated units] in
osdp/contract.py).

The layout a plan was made for is ``settings.layout`` ("full" or "hsdp") with
``node_size``, the ranks per node within the shard group the plan priced (for "hsdp" the
shard group). A plan file from before layouts has neither: it is a "full" plan for any
node size ([Note: plan and layout] in osdp/contract.py).
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import numbers
import os
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..contract import LAYOUT_FULL, LAYOUTS, MODE_REP, MODES, SHARDED_MODES, RuntimeConfig, plan_shard_size
from ..errors import OSDPError, PlanMismatchError, a_type
from ..sizes import format_bytes
from .calibration import Measurement
from .calibration_record import CalibrationRecord
from .checks import read_json_file

PLAN_VERSION = 1


@dataclass(frozen=True)
class UnitDecision:
    name: str
    kind: str
    param_bytes: int
    modes: tuple[str, ...]  # one per slice; len = slice count
    checkpointed: bool = False
    split_op: str = ""  # the registered split op (osdp.ops) cutting it, when split
    # priced frozen: no gradient, optimizer state or reduction ([Note: frozen units] in
    # the cost model); the runtime warns if it trains. Stored only when true
    frozen: bool = False

    @property
    def slices(self) -> int:
        return len(self.modes)

    @property
    def zdp_slices(self) -> int:
        return sum(m == "zdp" for m in self.modes)

    @property
    def hpz_slices(self) -> int:
        return sum(m == "hpz" for m in self.modes)

    @property
    def replicated(self) -> bool:
        """Whether the unit is ``rep`` (whole, never gathered, all-reduced)."""
        return self.modes == (MODE_REP,)

    @property
    def label(self) -> str:
        if self.slices == 1:
            return self.modes[0]
        hpz = f"{self.hpz_slices} hpz / " if self.hpz_slices else ""
        return (f"{self.slices} slices: {self.zdp_slices} zdp / {hpz}"
                f"{self.slices - self.zdp_slices - self.hpz_slices} dp")


@dataclass(frozen=True)
class Prediction:
    batch_size: int  # per device
    step_s: float
    samples_per_s: float  # global: batch * world size / step
    peak_bytes: float
    peak_op: str = ""
    breakdown: dict = field(default_factory=dict)
    # the step as the runtime schedules it (planner/step_sim.py); None: not simulated
    simulated_step_s: float | None = None
    simulated_samples_per_s: float | None = None
    # simulated seconds per phase of one optimizer step ("forward", "backward", "optimizer")
    phases: dict | None = None


@dataclass(frozen=True)
class Plan:
    model_name: str
    fingerprint: str
    world_size: int
    memory_limit_bytes: float
    batch_size: int
    prefetch_bytes: int
    units: tuple[UnitDecision, ...]
    checkpoint_blocks: tuple[str, ...]
    predicted: Prediction
    baselines: dict  # "fsdp" / "shard_grad_op" / "ddp" (+ "_ckpt" variants) -> Prediction | None
    device_name: str = ""
    search_s: float = 0.0
    searches: int = 0
    quantum_bytes: float = 0.0
    rounding_bound_bytes: float = 0.0  # worst-case over-estimate from quantization
    settings: dict = field(default_factory=dict)
    accumulation_steps: int = 1  # micro-batches of batch_size per optimizer step
    gradient_sync: str = "last"  # reduce-scatter after "every" micro-batch or the "last"
    notes: tuple[str, ...] = ()  # what the planner wants the reader to know (e.g. a capped batch)
    version: int = PLAN_VERSION
    # candidates priced by the step simulation and the one picked (planner/rerank.py)
    rerank: dict = field(default_factory=dict)
    # ranks per node within the shard group the plan priced; None: any (a flat network,
    # or a plan from before layouts). The layout is settings["layout"].
    node_size: int | None = None

    # [Note: measured beside predicted] what the runtime measured running this plan
    # (osdp.profiler.measure_plan: Measurement.to_dict(): step_s, forward_s, backward_s,
    # optimizer_s, peak_bytes, batch_size, steps, peak_source, groups, compiled); {}: not measured
    measured: dict = field(default_factory=dict)
    # auto mode's calibration (osdp/auto.py): the factors fitted, why, the predictions
    # per phase and unit group, and the other plan measured when a re-plan was tried
    # ([Note: calibration record] in osdp/planner/calibration_record.py); the empty
    # record (falsy, written {}) when not calibrated. A dict or None given here is
    # read as the record (CalibrationRecord.from_dict).
    calibration: CalibrationRecord = field(default_factory=CalibrationRecord)
    # the loss auto mode assumed when it was given no loss_fn ([Note: example inputs and the
    # loss] in osdp/planner/inputs.py): the memory the plan promises is for that loss; ""
    # when the loss was the caller's (loss_fn, output.loss) or the plan was made otherwise
    assumed_loss: str = ""

    def __post_init__(self):
        if not isinstance(self.calibration, CalibrationRecord):
            object.__setattr__(self, "calibration", CalibrationRecord.from_dict(self.calibration))

    @property
    def layout(self) -> str:
        """"full" or "hsdp" ([Note: plan and layout] in osdp/contract.py)."""
        return self.settings.get("layout", LAYOUT_FULL)

    @property
    def shard_size(self) -> int | None:
        """Ranks every unit is sharded over (None: an "hsdp" plan without its node size)."""
        return plan_shard_size(self.layout, self.world_size, self.node_size)

    # ---- what the runtime reads -------------------------------------------------
    def unit_modes(self) -> dict[str, tuple[str, ...]]:
        """Module path -> per-slice modes (the tuple's length is the slice count)."""
        return {u.name: u.modes for u in self.units}

    def unit_split_ops(self) -> dict[str, str]:
        """Split unit -> the split op the plan priced it with."""
        return {u.name: u.split_op for u in self.units if u.slices > 1 and u.split_op}

    def runtime_config(self) -> RuntimeConfig:
        """What the runtime executes (see ``osdp.contract``)."""
        return RuntimeConfig(
            unit_modes=self.unit_modes(),
            split_ops=self.unit_split_ops(),
            prefetch_bytes=self.prefetch_bytes,
            checkpoint_blocks=tuple(self.checkpoint_blocks),
            world_size=self.world_size,
            batch_size=self.batch_size,
            accumulation_steps=self.accumulation_steps,
            gradient_sync=self.gradient_sync,
            fingerprint=self.fingerprint,
            model_name=self.model_name,
            unit_param_bytes={u.name: u.param_bytes for u in self.units},
            param_dtype_bytes=self.settings.get("param_dtype_bytes"),
            reduce_dtype_bytes=self.settings.get("reduce_dtype_bytes"),
            layout=self.layout,
            node_size=self.node_size,
            shard_size=self.shard_size,
            frozen_units=tuple(u.name for u in self.units if u.frozen),
        )

    @property
    def speedup_over_fsdp(self) -> float | None:
        base = self.baselines.get("fsdp")
        return None if base is None else self.predicted.samples_per_s / base.samples_per_s

    def plan_hash(self) -> str:
        """Hash of everything the runtime acts on: equal on every rank or abort."""
        core = {
            "fingerprint": self.fingerprint,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "prefetch_bytes": self.prefetch_bytes,
            "units": [(u.name, u.modes) + ((u.split_op,) if u.slices > 1 and u.split_op else ()) for u in self.units],
            "checkpoint_blocks": list(self.checkpoint_blocks),
            "accumulation": [self.accumulation_steps, self.gradient_sync],
            "layout": [self.layout, self.node_size],
        }
        return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()[:16]

    def check_model(self, fingerprint: str, world_size: int | None = None) -> None:
        if fingerprint != self.fingerprint:
            raise PlanMismatchError(
                f"this plan was made for model {self.model_name!r} (fingerprint {self.fingerprint}); "
                f"the model given has fingerprint {fingerprint}: make a new plan for it"
            )
        if world_size is not None and world_size != self.world_size:
            raise PlanMismatchError(
                f"this plan was made for world size {self.world_size}, the process group has "
                f"{world_size} ranks: plan again for {world_size}"
            )

    # ---- storage -------------------------------------------------------------------
    def to_dict(self) -> dict:
        data = asdict(self)
        data["units"] = [dict(asdict(u), modes=list(u.modes), slices=u.slices) for u in self.units]
        for unit in data["units"]:
            if not unit["frozen"]:  # a trained unit's entry is as before units could be frozen
                del unit["frozen"]
        data["notes"] = list(self.notes)
        data["calibration"] = copy.deepcopy(self.calibration.to_dict())
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        """A plan from its JSON form, every field checked ([Note: checked plan files])."""
        if not isinstance(data, dict) or "version" not in data:
            raise OSDPError("not an OSDP plan: the JSON has no 'version' field")
        if data["version"] != PLAN_VERSION:
            raise OSDPError(
                f"plan version {data['version']!r} is not supported by this OSDP (reads version {PLAN_VERSION})"
            )
        _check_keys(data, "plan", cls)
        settings = _field(data, "settings", dict, "an object", default={})
        max_slices = settings.get("max_slices")
        units = tuple(_unit(u, i, max_slices) for i, u in enumerate(_field(data, "units", (list, tuple), "a list")))
        blocks = _field(data, "checkpoint_blocks", (list, tuple), "a list of module paths")
        if not all(isinstance(b, str) for b in blocks):
            raise OSDPError(f"plan field 'checkpoint_blocks' must list module paths (strings), got {blocks!r}")
        notes = _field(data, "notes", (list, tuple), "a list of strings", default=[])
        baselines = _field(data, "baselines", dict, "an object", default={})
        fields_ = dict(data)
        fields_.update(
            model_name=_field(data, "model_name", str, "a string"),
            fingerprint=_field(data, "fingerprint", str, "a string"),
            world_size=_count(data, "world_size", minimum=1),
            memory_limit_bytes=_size(data, "memory_limit_bytes", positive=True),
            batch_size=_count(data, "batch_size", minimum=1),
            prefetch_bytes=_count(data, "prefetch_bytes", minimum=0),
            accumulation_steps=_count(data, "accumulation_steps", minimum=1, default=1),
            units=units,
            checkpoint_blocks=tuple(blocks),
            notes=tuple(str(n) for n in notes),
            predicted=_prediction(data.get("predicted"), "predicted"),
            baselines={k: None if v is None else _prediction(v, f"baselines[{k!r}]") for k, v in baselines.items()},
            settings=settings,
            device_name=_field(data, "device_name", str, "a string", default=""),
            search_s=_size(data, "search_s", False) if "search_s" in data else 0.0,
            searches=_count(data, "searches", minimum=0, default=0),
            quantum_bytes=_size(data, "quantum_bytes", False) if "quantum_bytes" in data else 0.0,
            rounding_bound_bytes=_size(data, "rounding_bound_bytes", False) if "rounding_bound_bytes" in data else 0.0,
            assumed_loss=_field(data, "assumed_loss", str, "a string", default=""),
        )
        fields_["measured"] = _field(data, "measured", dict, "an object", default={})
        fields_["calibration"] = CalibrationRecord.from_dict(_field(data, "calibration", dict, "an object",
                                                                    default={}))
        if fields_["measured"]:
            Measurement.from_dict(fields_["measured"], "plan field 'measured'")  # checked, kept as JSON
        if fields_.get("gradient_sync", "last") not in ("every", "last"):
            raise OSDPError(f"plan field 'gradient_sync' must be 'every' or 'last', got {data['gradient_sync']!r}")
        if fields_["predicted"] is None:
            raise OSDPError("plan field 'predicted' is missing")
        _check_layout(fields_)
        return cls(**fields_)

    def save(self, path) -> None:
        """Atomic write: a crash leaves the old file or the new one, never half."""
        path = Path(path)
        check_writable(path, "plan")
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        try:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        except OSError as exc:
            raise OSDPError(f"cannot write the plan to {path}: directory {path.parent} is not writable "
                            f"({exc.strerror})") from None
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path, fingerprint: str | None = None) -> "Plan":
        path = Path(path)
        if not path.exists():
            raise OSDPError(f"plan file {path} does not exist")
        if path.is_dir():
            raise OSDPError(f"plan file {path} is a directory; give the plan's JSON file")
        data = read_json_file(path, "plan file")
        try:
            plan = cls.from_dict(data)
        except PlanMismatchError:
            raise
        except OSDPError as exc:
            raise OSDPError(f"plan file {path}: {exc}") from None
        if fingerprint is not None:
            plan.check_model(fingerprint)
        return plan

    # ---- reading ---------------------------------------------------------------------
    def __str__(self) -> str:
        return format_plan(self)


def plan_from_arg(plan):
    """What ``osdp.OSDP(module, plan=...)`` accepts: a plan object as it is (duck typed:
    anything with ``unit_modes()``), the path (str or os.PathLike) of a plan JSON file
    (``Plan.load``), a dict in the plan's JSON form, or None."""
    if plan is None or hasattr(plan, "unit_modes"):
        return plan
    if isinstance(plan, (str, os.PathLike)):
        return Plan.load(plan)
    if isinstance(plan, dict):
        return Plan.from_dict(plan)
    raise OSDPError(
        f"plan must be an osdp Plan, the path of a plan JSON file (from `osdp plan --json` or "
        f"Plan.save), or None; got {plan!r} ({a_type(plan)})"
    )


# ---- checking a plan's JSON ([Note: checked plan files]) -----------------------------
_MISSING = object()


def check_writable(path: Path, what: str) -> None:
    """Refuse, before any work, a path whose directory does not exist or that is a
    directory itself: the error names the directory, not a temporary file."""
    path = Path(path)
    parent = path.parent
    if path.is_dir():
        raise OSDPError(f"cannot write the {what} to {path}: it is a directory; give a file name in it")
    if not parent.is_dir():
        raise OSDPError(f"cannot write the {what} to {path}: directory {parent} does not exist (create it first)")


def _check_keys(data: dict, where: str, cls) -> None:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise OSDPError(f"{where} has unknown fields {unknown}; known: {sorted(known)}")


def _field(data: dict, name: str, kind, what: str, where: str = "plan field", default=_MISSING):
    if name not in data:
        if default is not _MISSING:
            return default
        raise OSDPError(f"{where} {name!r} is missing")
    value = data[name]
    if not isinstance(value, kind):
        raise OSDPError(f"{where} {name!r} must be {what}, got {value!r} ({a_type(value)})")
    return value


def _count(data: dict, name: str, minimum: int, where: str = "plan field", default=_MISSING) -> int:
    value = data.get(name, default)
    if value is _MISSING:
        raise OSDPError(f"{where} {name!r} is missing")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise OSDPError(f"{where} {name!r} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _size(data: dict, name: str, positive: bool, where: str = "plan field") -> float:
    if name not in data:
        raise OSDPError(f"{where} {name!r} is missing")
    value = data[name]
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value <= 0 if positive else value < 0):
        raise OSDPError(f"{where} {name!r} must be a number {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def _check_layout(fields_: dict) -> None:
    """``settings.layout`` and ``node_size`` ([Note: plan and layout]); both may be
    missing (a plan from before layouts: "full", any node size)."""
    layout = fields_["settings"].get("layout", LAYOUT_FULL)
    if layout not in LAYOUTS:
        raise OSDPError(f"plan field 'settings.layout' must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    if fields_.get("node_size") is None:
        fields_["node_size"] = None
        return
    node = fields_["node_size"] = _count(fields_, "node_size", minimum=1)
    world = fields_["world_size"]
    if world % node:
        raise OSDPError(f"plan field 'node_size' is {node}, which does not divide the plan's world_size {world} "
                        "into whole nodes")


def _unit(raw, i: int, max_slices) -> UnitDecision:
    where = f"units[{i}]"
    if not isinstance(raw, dict):
        raise OSDPError(f"plan field {where} must be an object, got {raw!r} ({a_type(raw)})")
    raw = dict(raw)
    slices = raw.pop("slices", None)
    _check_keys(raw, f"plan field {where}", UnitDecision)
    name = _field(raw, "name", str, "a string", f"plan field {where}")
    where = f"{where} ({name})"
    modes = _field(raw, "modes", (list, tuple), "a list of modes ('dp', 'zdp', 'hpz', 'rep'), one per slice",
                   f"plan field {where}")
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise OSDPError(f"plan field {where}.modes is {list(modes)}; each slice must be one of {', '.join(map(repr, MODES))} (at least one)")
    if slices is not None and (isinstance(slices, bool) or not isinstance(slices, int) or slices != len(modes)):
        raise OSDPError(
            f"plan field {where}.modes lists {len(modes)} slice modes but {where}.slices is {slices!r}: "
            "a unit's slice count is the length of its modes; change both (or make a new plan)"
        )
    if len(modes) > 1 and MODE_REP in modes:
        raise OSDPError(f"plan field {where}.modes is {list(modes)}: {MODE_REP!r} (replicated) is for whole units only, "
                        f"not for a slice of a split unit; give the unit one mode ['rep'], or each slice one of "
                        f"{', '.join(map(repr, SHARDED_MODES))} (see [Note: replicated units] in osdp/contract.py)")
    if isinstance(max_slices, int) and len(modes) > max(max_slices, 1):
        raise OSDPError(
            f"plan field {where}.modes lists {len(modes)} slices, more than the plan's settings.max_slices = "
            f"{max_slices}; make a new plan with a higher max_slices"
        )
    checkpointed = raw.get("checkpointed", False)
    if not isinstance(checkpointed, bool):
        raise OSDPError(f"plan field {where}.checkpointed must be true or false, got {checkpointed!r}")
    if not isinstance(raw.get("frozen", False), bool):
        raise OSDPError(f"plan field {where}.frozen must be true or false, got {raw['frozen']!r}")
    raw.update(  # fields not checked here pass through as they are
        name=name,
        kind=_field(raw, "kind", str, "a string", f"plan field {where}"),
        param_bytes=_count(raw, "param_bytes", 0, f"plan field {where}"),
        modes=tuple(modes),
        checkpointed=checkpointed,
    )
    return UnitDecision(**raw)


def _prediction(raw, where: str) -> Prediction | None:
    if raw is None:
        return None
    where = f"plan field {where}"
    if not isinstance(raw, dict):
        raise OSDPError(f"{where} must be an object, got {raw!r} ({a_type(raw)})")
    _check_keys(raw, where, Prediction)
    return Prediction(**dict(  # fields not checked here pass through as they are
        raw,
        batch_size=_count(raw, "batch_size", 1, where),
        step_s=_size(raw, "step_s", True, where),
        samples_per_s=_size(raw, "samples_per_s", True, where),
        peak_bytes=_size(raw, "peak_bytes", False, where),
        peak_op=_field(raw, "peak_op", str, "a string", where, default=""),
        breakdown=_field(raw, "breakdown", dict, "an object", where, default={}),
    ))


def format_plan(plan: Plan, max_rows: int = 60) -> str:
    p = plan.predicted
    lines = [
        f"OSDP plan for {plan.model_name} (fingerprint {plan.fingerprint}) on {plan.device_name or '?'}",
        f"  world size {plan.world_size}, memory limit {format_bytes(plan.memory_limit_bytes)}, "
        f"batch {plan.batch_size}/device"
        + (f" x {plan.accumulation_steps} micro-batches (grads reduced after {plan.gradient_sync})"
           if plan.accumulation_steps > 1 else "")
        + f", prefetch window {format_bytes(plan.prefetch_bytes)}",
        f"  predicted: step {p.step_s * 1e3:.2f} ms, {p.samples_per_s:.2f} samples/s, "
        f"peak {format_bytes(p.peak_bytes)} at {p.peak_op}",
    ]
    if plan.node_size is not None or plan.layout != LAYOUT_FULL:
        lines.append("  layout: " + layout_label(plan.layout, plan.world_size, plan.node_size))
    if p.breakdown:
        lines.append("  peak breakdown: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in p.breakdown.items()))
    if p.simulated_step_s is not None:
        picked = plan.rerank.get("picked")
        lines.append(f"  simulated as the runtime schedules it: step {p.simulated_step_s * 1e3:.2f} ms, "
                     f"{p.simulated_samples_per_s:.2f} samples/s"
                     + (f" (re-ranked: {picked!r} picked among {len(plan.rerank.get('candidates', []))} candidates)"
                        if picked else ""))
    if plan.measured:
        m = plan.measured
        lines.append(f"  measured on the runtime{' (compiled)' if m.get('compiled') else ''}: step {m['step_s'] * 1e3:.2f} ms "
                     f"({plan.batch_size * plan.accumulation_steps * plan.world_size / m['step_s']:.2f} samples/s), "
                     f"peak {format_bytes(m['peak_bytes'])}" + (f" ({m['peak_source']})" if m.get("peak_source") else ""))
    if plan.calibration.decision:
        lines.append(f"  calibration: {plan.calibration.decision}")
    for key, label in (("fsdp", "FSDP full shard (all zdp)"), ("shard_grad_op", "shard-grad-op (all dp)"),
                       ("ddp", "DDP (all rep)"), ("fsdp_ckpt", "FSDP + checkpointing")):
        if key not in plan.baselines:
            continue
        b = plan.baselines[key]
        if b is None:
            lines.append(f"  {label}: does not fit")
        else:
            lines.append(
                f"  {label}: batch {b.batch_size}, {b.samples_per_s:.2f} samples/s, peak {format_bytes(b.peak_bytes)}"
                f" -> OSDP is {p.samples_per_s / b.samples_per_s:.2f}x"
            )
    lines.append(f"  search: {plan.search_s * 1e3:.1f} ms over {plan.searches} exact searches, "
                 f"memory quantum {format_bytes(plan.quantum_bytes)} "
                 f"(worst-case rounding {format_bytes(plan.rounding_bound_bytes)})")
    lines.extend(f"  note: {note}" for note in plan.notes)
    if plan.assumed_loss:
        lines.append(f"  loss: assumed (no loss_fn given): {plan.assumed_loss}")
    lines.append("")
    lines.append(f"  {'unit':<34} {'kind':<10} {'weights':>11}  decision")
    rows = _collapse(plan.units)
    for name, unit, count in rows[:max_rows]:
        ckpt = "  [ckpt]" if unit.checkpointed else ""
        label = name if count == 1 else f"{name} (x{count})"
        lines.append(f"  {label:<34} {unit.kind:<10} {format_bytes(unit.param_bytes):>11}  {unit.label}{ckpt}")
    if len(rows) > max_rows:
        lines.append(f"  ... {len(rows) - max_rows} more rows")
    return "\n".join(lines)


def layout_label(layout: str, world_size: int, node_size: int | None) -> str:
    """How a plan's layout reads, with the arguments that run it ([Note: plan and layout])."""
    if layout == LAYOUT_FULL:
        nodes = "" if node_size is None else f", {world_size // node_size} node(s) of {node_size} (node_size={node_size})"
        return f"full shard over {world_size} ranks{nodes}"
    shard = "?" if node_size is None else node_size
    replicas = "?" if node_size is None else world_size // node_size
    return (f"hsdp: {replicas} replicas x shard groups of {shard} (mesh=init_device_mesh(device, "
            f"({replicas}, {shard}), mesh_dim_names=('replicate', 'shard')))")


def _collapse(units):
    """Units of identical layers with identical decisions share one row:
    ``blocks.*.attn.c_attn (x96)``; differing decisions get rows of their own."""
    import re

    rows: dict = {}
    for u in units:
        pattern = re.sub(r"\.\d+\.", ".*.", u.name)
        key = (pattern, u.kind, u.param_bytes, u.modes, u.checkpointed)
        if key in rows:
            name, unit, count = rows[key]
            rows[key] = (pattern, unit, count + 1)
        else:
            rows[key] = (u.name, u, 1)
    return list(rows.values())

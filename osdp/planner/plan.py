"""Plan: what the planner decided, what it predicts, and how it is stored.

A plan names every unit by its module path with its slice count and per-slice modes,
the blocks to checkpoint, the batch size and prefetch window, and the predictions (step
time, samples/s, peak memory with its breakdown) beside those of FSDP full shard
(all ``zdp``) and shard-grad-op (all ``dp``) at the same memory limit. Saved as
versioned JSON with the model's fingerprint, so a plan is only used with its model.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import OSDPError, PlanMismatchError

PLAN_VERSION = 1
MODES = ("dp", "zdp")


@dataclass(frozen=True)
class UnitDecision:
    name: str
    kind: str
    param_bytes: int
    modes: tuple[str, ...]  # one per slice; len = slice count
    checkpointed: bool = False

    @property
    def slices(self) -> int:
        return len(self.modes)

    @property
    def zdp_slices(self) -> int:
        return sum(m == "zdp" for m in self.modes)

    @property
    def label(self) -> str:
        if self.slices == 1:
            return self.modes[0]
        return f"{self.slices} slices: {self.zdp_slices} zdp / {self.slices - self.zdp_slices} dp"


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
    baselines: dict  # "fsdp" / "shard_grad_op" (+ "_ckpt" variants) -> Prediction | None
    device_name: str = ""
    search_s: float = 0.0
    searches: int = 0
    quantum_bytes: float = 0.0
    rounding_bound_bytes: float = 0.0  # worst-case over-estimate from quantization
    settings: dict = field(default_factory=dict)
    accumulation_steps: int = 1  # micro-batches of batch_size per optimizer step
    gradient_sync: str = "last"  # reduce-scatter after "every" micro-batch or the "last"
    version: int = PLAN_VERSION
    # candidates priced by the step simulation and the one picked (planner/rerank.py)
    rerank: dict = field(default_factory=dict)

    # ---- what the runtime reads -------------------------------------------------
    def unit_modes(self) -> dict[str, tuple[str, ...]]:
        """Module path -> per-slice modes (the tuple's length is the slice count)."""
        return {u.name: u.modes for u in self.units}

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
            "units": [(u.name, u.modes) for u in self.units],
            "checkpoint_blocks": list(self.checkpoint_blocks),
            "accumulation": [self.accumulation_steps, self.gradient_sync],
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
        data["units"] = [dict(asdict(u), modes=list(u.modes)) for u in self.units]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        if not isinstance(data, dict) or "version" not in data:
            raise OSDPError("not an OSDP plan: the JSON has no 'version' field")
        if data["version"] != PLAN_VERSION:
            raise OSDPError(
                f"plan version {data['version']} is not supported by this OSDP (reads version {PLAN_VERSION})"
            )
        try:
            units = tuple(UnitDecision(**dict(u, modes=tuple(u["modes"]))) for u in data["units"])
            for u in units:
                bad = [m for m in u.modes if m not in MODES]
                if bad or not u.modes:
                    raise OSDPError(f"unit {u.name!r} has modes {list(u.modes)}; each slice must be 'dp' or 'zdp'")

            def pred(p):
                return None if p is None else Prediction(**p)

            fields_ = dict(data)
            fields_.update(
                units=units,
                checkpoint_blocks=tuple(data["checkpoint_blocks"]),
                predicted=pred(data["predicted"]),
                baselines={k: pred(v) for k, v in data.get("baselines", {}).items()},
            )
            return cls(**fields_)
        except (KeyError, TypeError) as exc:
            raise OSDPError(f"malformed plan: {exc}") from None

    def save(self, path) -> None:
        """Atomic write: a crash leaves the old file or the new one, never half."""
        path = Path(path)
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        fd, tmp = tempfile.mkstemp(dir=path.parent or ".", prefix=f".{path.name}.", suffix=".tmp")
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
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise OSDPError(f"plan file {path} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
        plan = cls.from_dict(data)
        if fingerprint is not None:
            plan.check_model(fingerprint)
        return plan

    # ---- reading ---------------------------------------------------------------------
    def __str__(self) -> str:
        return format_plan(self)


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


def format_plan(plan: Plan, max_rows: int = 60) -> str:
    p = plan.predicted
    lines = [
        f"OSDP plan for {plan.model_name} (fingerprint {plan.fingerprint}) on {plan.device_name or '?'}",
        f"  world size {plan.world_size}, memory limit {_gib(plan.memory_limit_bytes)}, "
        f"batch {plan.batch_size}/device"
        + (f" x {plan.accumulation_steps} micro-batches (grads reduced after {plan.gradient_sync})"
           if plan.accumulation_steps > 1 else "")
        + f", prefetch window {plan.prefetch_bytes / 2**20:.1f} MiB",
        f"  predicted: step {p.step_s * 1e3:.2f} ms, {p.samples_per_s:.2f} samples/s, "
        f"peak {_gib(p.peak_bytes)} at {p.peak_op}",
    ]
    if p.breakdown:
        lines.append("  peak breakdown: " + ", ".join(f"{k} {_gib(v)}" for k, v in p.breakdown.items()))
    if p.simulated_step_s is not None:
        picked = plan.rerank.get("picked")
        lines.append(f"  simulated as the runtime schedules it: step {p.simulated_step_s * 1e3:.2f} ms, "
                     f"{p.simulated_samples_per_s:.2f} samples/s"
                     + (f" (re-ranked: {picked!r} picked among {len(plan.rerank.get('candidates', []))} candidates)"
                        if picked else ""))
    for key, label in (("fsdp", "FSDP full shard (all zdp)"), ("shard_grad_op", "shard-grad-op (all dp)"),
                       ("fsdp_ckpt", "FSDP + checkpointing")):
        if key not in plan.baselines:
            continue
        b = plan.baselines[key]
        if b is None:
            lines.append(f"  {label}: does not fit")
        else:
            lines.append(
                f"  {label}: batch {b.batch_size}, {b.samples_per_s:.2f} samples/s, peak {_gib(b.peak_bytes)}"
                f" -> OSDP is {p.samples_per_s / b.samples_per_s:.2f}x"
            )
    lines.append(f"  search: {plan.search_s * 1e3:.1f} ms over {plan.searches} exact searches, "
                 f"memory quantum {plan.quantum_bytes / 2**20:.2f} MiB "
                 f"(worst-case rounding {_gib(plan.rounding_bound_bytes)})")
    lines.append("")
    lines.append(f"  {'unit':<34} {'kind':<10} {'MiB':>9}  decision")
    rows = _collapse(plan.units)
    for name, unit, count in rows[:max_rows]:
        ckpt = "  [ckpt]" if unit.checkpointed else ""
        label = name if count == 1 else f"{name} (x{count})"
        lines.append(f"  {label:<34} {unit.kind:<10} {unit.param_bytes / 2**20:9.2f}  {unit.label}{ckpt}")
    if len(rows) > max_rows:
        lines.append(f"  ... {len(rows) - max_rows} more rows")
    return "\n".join(lines)


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

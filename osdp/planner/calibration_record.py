"""CalibrationRecord: what auto mode's calibration wrote on a plan (``Plan.calibration``).

[Note: calibration record]
Auto mode (osdp/auto.py ``calibrate_plan``, osdp/measured_choice.py, the planning budget)
writes, on the plan it hands out, why and how it calibrated: the factors the plan was
made with, the predictions beside the measurement, the plans measured beside it and the
budget spent. The record is typed (each field below), and stored in the plan's JSON as
the object it always was: ``to_dict()`` writes the keys present, in the order they were
set (a key set again keeps its place, a new key goes last, as a dict's update does), so
the JSON of a plan is byte for byte what the untyped dict wrote. A key absent stays
absent; keys this OSDP does not know are kept as read (``extra``).

``from_dict`` checks the type of every key it knows and names the one that is wrong
(``plan field 'calibration.budget'``), like the plan's other fields; a missing key is
an absent one.

Reading it the old way (``plan.calibration["budget"]``, ``.get("decision")``, ``in``,
``keys()``) still works, with a DeprecationWarning: read the attributes
(``plan.calibration.budget``). An uncalibrated plan has the empty record, which is
falsy (``plan.calibration or {}`` keeps working) and written as ``{}``.

Planner layer, torch-free: imports neither osdp.runtime nor osdp.auto.
"""
from __future__ import annotations

import numbers
import warnings
from dataclasses import dataclass, field, fields

from ..errors import OSDPError, a_type
from .device import Calibration

_WHERE = "plan field 'calibration"


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _bad(name: str, what: str, value) -> OSDPError:
    return OSDPError(f"{_WHERE}.{name}' must be {what}, got {value!r} ({a_type(value)})")


def _number(name, value):
    if not _is_number(value):
        raise _bad(name, "a number", value)
    return value


def _optional_number(name, value):
    if value is not None and not _is_number(value):
        raise _bad(name, "a number or null", value)
    return value


def _string(name, value):
    if not isinstance(value, str):
        raise _bad(name, "a string", value)
    return value


def _object(name, value):
    if not isinstance(value, dict):
        raise _bad(name, "an object", value)
    return value


def _strings(name, value):
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise _bad(name, "a list of strings", value)
    return tuple(value)


def _objects(name, value):
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, dict) for v in value):
        raise _bad(name, "a list of objects", value)
    return tuple(value)


def _numbers_by_name(name, value):
    _object(name, value)
    for k, v in value.items():
        if not _is_number(v):
            raise _bad(f"{name}[{k!r}]", "a number (seconds)", v)
    return value


def _other(name, value):
    _object(name, value)
    for key in ("plan", "measured"):
        if key in value:
            _object(f"{name}.{key}", value[key])
    return value


def _measured_choice(name, value):
    _object(name, value)
    if "candidates" in value:
        _objects(f"{name}.candidates", value["candidates"])
    if "kept" in value:
        _string(f"{name}.kept", value["kept"])
    if "tiebreak" in value:
        _object(f"{name}.tiebreak", value["tiebreak"])
    return value


def _budget(name, value):
    _object(name, value)
    if "budget_s" in value:
        _optional_number(f"{name}.budget_s", value["budget_s"])
    if "spent_s" in value:
        _number(f"{name}.spent_s", value["spent_s"])
    if "cuts" in value:
        _strings(f"{name}.cuts", value["cuts"])
    return value


def _compiled(name, value):
    _object(name, value)
    for key in ("step_s", "eager_step_s", "first_step_s", "predicted_step_s", "compute_scale",
                "backward_compute_scale", "eager_compute_scale", "eager_backward_compute_scale"):
        if key in value:
            _number(f"{name}.{key}", value[key])
    for key in ("scope", "kept"):
        if key in value:
            _string(f"{name}.{key}", value[key])
    if "finalists" in value:
        _objects(f"{name}.finalists", value["finalists"])
    return value


# each known key: its check (returns the value as the record holds it)
_CHECKS = {
    "factors": _object,
    "memory_bandwidth_bytes_per_s": _optional_number,
    "constant_bytes": _number,
    "reasons": _strings,
    "observations": _objects,
    "decision": _string,
    "other": _other,
    "predicted_phases": _numbers_by_name,
    "predicted_step_s": _number,
    "predicted_groups": _numbers_by_name,
    "predicted_error": _string,
    "measured_choice": _measured_choice,
    "budget": _budget,
    "compiled": _compiled,
}
# JSON form of a held value (tuples are written as lists, as the dict held them)
_LISTS = ("reasons", "observations")


@dataclass(frozen=True, eq=False)
class CalibrationRecord:
    """[Note: calibration record]. Every field is None when its key is absent."""
    # the factors (``asdict(osdp.planner.device.Calibration)``) of the device the plan
    # was made on: the profile's, or those refitted to the measurements (``factors_calibration``)
    factors: dict | None = None
    # the optimizer's memory bandwidth and the memory constant of that device
    memory_bandwidth_bytes_per_s: float | None = None
    constant_bytes: float | None = None
    # why the model was refitted (``calibration.reasons_to_refit``; empty: it was not)
    reasons: tuple[str, ...] | None = None
    # every measurement at its batch: {"plan", "batch_size", "measured", "refitted_to"}
    observations: tuple[dict, ...] | None = None
    decision: str | None = None  # kept or re-planned, and why
    # the plan measured beside it when a re-plan was tried: {"plan": plan dict, "measured"}
    other: dict | None = None
    # the predictions beside the measurement (``calibration.predictions``): per phase,
    # the step, per unit group; or why there are none
    predicted_phases: dict | None = None
    predicted_step_s: float | None = None
    predicted_groups: dict | None = None
    predicted_error: str | None = None
    # [Note: measured choice]: {"candidates": [...], "kept": hash, "tiebreak"?: {...}}
    measured_choice: dict | None = None
    # the planning budget (``PlanningBudget.record()``): {"budget_s", "spent_s", "cuts"}
    budget: dict | None = None
    # the plans measured compiled (auto mode with compile=): {"scope", "step_s",
    # "eager_step_s", "first_step_s" (the kept plan's), "finalists": [{"plan",
    # "batch_size", "eager_samples_per_s", "samples_per_s", "peak_bytes", "repeats"}],
    # "kept", and from the fit to the finalists' compiled steps: "compute_scale",
    # "backward_compute_scale" (and the eager fit's, "eager_"-prefixed),
    # "predicted_step_s"}: see [Note: compiled plans] in osdp/compiled_choice.py
    compiled: dict | None = None
    # keys this OSDP does not know, as read
    extra: dict = field(default_factory=dict)
    # the keys present, in the order they are written (derived when not given)
    keys_order: tuple[str, ...] = ()

    def __post_init__(self):
        present = [f for f in _CHECKS if getattr(self, f) is not None]
        if not isinstance(self.extra, dict):
            raise _bad("extra", "an object", self.extra)
        unknown = [k for k in self.extra if k in _CHECKS]
        if unknown:
            raise OSDPError(f"CalibrationRecord.extra holds known keys {unknown}: set them as fields")
        if not self.keys_order:
            object.__setattr__(self, "keys_order", tuple(present) + tuple(self.extra))
        order = self.keys_order
        missing = [k for k in present + list(self.extra) if k not in order]
        stray = [k for k in order if k not in _CHECKS and k not in self.extra]
        if missing or stray or len(set(order)) != len(order):
            raise OSDPError(f"CalibrationRecord.keys_order {order!r} does not list the keys present "
                            f"(missing {missing}, stray {stray})")
        for name in present:
            object.__setattr__(self, name, _CHECKS[name](name, getattr(self, name)))

    # ---- building ----------------------------------------------------------------------
    def with_(self, **changes) -> CalibrationRecord:
        """The record with ``changes`` set, as a dict's ``update``: a key already present
        keeps its place, a new one goes last. Unknown keys go to ``extra``."""
        values = {f: getattr(self, f) for f in _CHECKS}
        extra = dict(self.extra)
        order = list(self.keys_order)
        for key, value in changes.items():
            if key in _CHECKS:
                values[key] = value
            else:
                extra[key] = value
            if key not in order:
                order.append(key)
        return CalibrationRecord(**values, extra=extra, keys_order=tuple(order))

    # ---- storage -----------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The JSON object, keys in the order they were set ({} when empty)."""
        out = {}
        for key in self.keys_order:
            value = getattr(self, key) if key in _CHECKS else self.extra[key]
            out[key] = list(value) if key in _LISTS and isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, data) -> CalibrationRecord:
        """A record from its JSON object, every known key checked; None or {}: the empty record."""
        if data is None:
            return cls()
        if isinstance(data, CalibrationRecord):
            return data
        if not isinstance(data, dict):
            raise OSDPError(f"{_WHERE}' must be an object, got {data!r} ({a_type(data)})")
        known = {k: v for k, v in data.items() if k in _CHECKS}
        extra = {k: v for k, v in data.items() if k not in _CHECKS}
        for key, value in known.items():
            if value is None and key != "memory_bandwidth_bytes_per_s":
                raise _bad(key, "set (not null)", value)
        return cls(**known, extra=extra, keys_order=tuple(data))

    # ---- reading -----------------------------------------------------------------------
    def factors_calibration(self) -> Calibration | None:
        """The factors as a ``Calibration`` (None when absent)."""
        if self.factors is None:
            return None
        return Calibration.from_dict(self.factors, "plan field 'calibration.factors'")

    def __bool__(self) -> bool:
        return bool(self.keys_order)

    def __eq__(self, other) -> bool:
        if not isinstance(other, CalibrationRecord):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None

    def __repr__(self) -> str:
        return f"CalibrationRecord({', '.join(self.keys_order)})"

    # ---- the old dict reading (deprecated) ---------------------------------------------
    def _deprecated(self, how: str) -> None:
        warnings.warn(f"plan.calibration{how}: the calibration record is typed; read its attributes "
                      "(plan.calibration.decision, .budget, ...) or plan.calibration.to_dict()",
                      DeprecationWarning, stacklevel=3)

    def __getitem__(self, key):
        self._deprecated(f"[{key!r}]")
        return self.to_dict()[key]

    def get(self, key, default=None):
        self._deprecated(f".get({key!r})")
        return self.to_dict().get(key, default)

    def __contains__(self, key) -> bool:
        self._deprecated(f" has {key!r}")
        return key in self.keys_order

    def keys(self):
        self._deprecated(".keys()")
        return self.to_dict().keys()

    def items(self):
        self._deprecated(".items()")
        return self.to_dict().items()

    def __iter__(self):
        self._deprecated(" iterated")
        return iter(self.keys_order)

    def __len__(self) -> int:
        return len(self.keys_order)


def calibration_fields() -> tuple[str, ...]:
    """The keys the record types (the rest are kept in ``extra``)."""
    return tuple(_CHECKS)


assert tuple(f.name for f in fields(CalibrationRecord))[:len(_CHECKS)] == tuple(_CHECKS)

"""[Note: calibration record]: Plan.calibration is typed, and a plan's JSON stays byte for
byte what the untyped dict wrote (the fixtures are plans written by auto mode and the
measured choice before the record existed)."""
from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path

import pytest

from osdp.errors import OSDPError
from osdp.planner.calibration_record import CalibrationRecord
from osdp.planner.device import Calibration
from osdp.planner.plan import Plan

DATA = Path(__file__).parent / "data"
FIXTURES = ["plan-calibrated-auto.json", "plan-calibrated-tiebreak.json"]


def _text(plan: Plan) -> str:
    return json.dumps(plan.to_dict(), indent=2) + "\n"  # what Plan.save writes


@pytest.mark.parametrize("name", FIXTURES)
def test_a_plan_written_before_the_record_loads_and_is_written_byte_for_byte(name, tmp_path):
    text = (DATA / name).read_text()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # no dict reads on the way
        plan = Plan.from_dict(json.loads(text))
        assert isinstance(plan.calibration, CalibrationRecord)
        assert _text(plan) == text
        plan.save(tmp_path / "plan.json")
        assert (tmp_path / "plan.json").read_text() == text
        assert Plan.load(tmp_path / "plan.json") == plan


def test_the_record_of_auto_mode_has_its_typed_fields():
    data = json.loads((DATA / "plan-calibrated-auto.json").read_text())["calibration"]
    record = CalibrationRecord.from_dict(data)
    assert record.to_dict() == data and list(record.to_dict()) == list(data)
    assert CalibrationRecord.from_dict(record.to_dict()) == record
    assert isinstance(record.factors_calibration(), Calibration)
    assert record.decision.startswith(("kept", "re-planned")) and record.reasons
    assert set(record.budget) == {"budget_s", "spent_s", "cuts"}
    assert record.measured_choice["kept"] and record.other["plan"]["version"] == 1
    assert record.predicted_step_s > 0 and set(record.predicted_phases) == {"forward", "backward", "optimizer"}
    assert record.observations[0]["batch_size"] >= 1 and record.extra == {}


def test_keys_keep_the_order_they_were_set_like_a_dict_update():
    record = CalibrationRecord().with_(decision="kept").with_(measured_choice={"candidates": [], "kept": "x"})
    record = record.with_(predicted_step_s=0.1, decision="kept again")
    assert list(record.to_dict()) == ["decision", "measured_choice", "predicted_step_s"]
    assert record.decision == "kept again"
    # built with no order given: the fields' order
    assert list(CalibrationRecord(budget={"cuts": []}, decision="d").to_dict()) == ["decision", "budget"]


def test_empty_and_unknown_keys():
    empty = CalibrationRecord.from_dict({})
    assert empty == CalibrationRecord() and not empty and empty.to_dict() == {}
    data = {"decision": "kept", "future_key": [1, {"a": 2}], "budget": {"budget_s": None, "spent_s": 1.5, "cuts": []}}
    record = CalibrationRecord.from_dict(data)
    assert record.extra == {"future_key": [1, {"a": 2}]}
    assert json.dumps(record.to_dict()) == json.dumps(data)


@pytest.mark.parametrize("key,value,expect", [
    ("decision", 3, "'calibration.decision' must be a string"),
    ("reasons", "slow", "'calibration.reasons' must be a list of strings"),
    ("factors", [1.0], "'calibration.factors' must be an object"),
    ("constant_bytes", "0", "'calibration.constant_bytes' must be a number"),
    ("predicted_step_s", True, "'calibration.predicted_step_s' must be a number"),
    ("predicted_phases", {"forward": "1 ms"}, "'calibration.predicted_phases['forward']' must be a number"),
    ("budget", {"spent_s": "1", "cuts": []}, "'calibration.budget.spent_s' must be a number"),
    ("budget", {"cuts": "all"}, "'calibration.budget.cuts' must be a list of strings"),
    ("measured_choice", {"kept": 7}, "'calibration.measured_choice.kept' must be a string"),
    ("observations", [1], "'calibration.observations' must be a list of objects"),
    ("compiled", {"step_s": "fast"}, "'calibration.compiled.step_s' must be a number"),
    ("compiled", {"scope": 1, "step_s": 0.1}, "'calibration.compiled.scope' must be a string"),
    ("compiled", {"step_s": 0.1, "finalists": "two"}, "'calibration.compiled.finalists' must be a list of objects"),
    ("compiled", {"step_s": 0.1, "kept": 3}, "'calibration.compiled.kept' must be a string"),
    ("decision", None, "'calibration.decision' must be set"),
])
def test_a_wrong_type_names_the_field(key, value, expect):
    data = json.loads((DATA / "plan-calibrated-tiebreak.json").read_text())
    data["calibration"][key] = value
    with pytest.raises(OSDPError, match="plan field " + expect.replace("[", r"\[").replace("]", r"\]")):
        Plan.from_dict(data)


def test_the_calibration_must_be_an_object():
    data = json.loads((DATA / "plan-calibrated-tiebreak.json").read_text())
    data["calibration"] = ["kept"]
    with pytest.raises(OSDPError, match="plan field 'calibration' must be an object"):
        Plan.from_dict(data)


def test_the_old_dict_reads_work_with_a_deprecation_warning():
    plan = Plan.from_dict(json.loads((DATA / "plan-calibrated-auto.json").read_text()))
    with pytest.warns(DeprecationWarning, match="plan.calibration\\['budget'\\]"):
        assert plan.calibration["budget"] == plan.calibration.budget
    with pytest.warns(DeprecationWarning):
        assert plan.calibration.get("decision") == plan.calibration.decision
    with pytest.warns(DeprecationWarning):
        assert plan.calibration.get("missing", 1) == 1
    with pytest.warns(DeprecationWarning):
        assert "other" in plan.calibration
    with pytest.warns(DeprecationWarning):
        assert dict(plan.calibration) == plan.calibration.to_dict()
    assert (Plan.from_dict({**plan.to_dict(), "calibration": {}}).calibration or {}) == {}  # falsy when empty


def test_a_dict_given_to_the_plan_is_read_as_the_record():
    plan = Plan.from_dict(json.loads((DATA / "plan-calibrated-tiebreak.json").read_text()))
    annotated = replace(plan, calibration={"decision": "kept", "factors": {"compute_scale": 1.1}})
    assert isinstance(annotated.calibration, CalibrationRecord) and annotated.calibration.decision == "kept"
    assert replace(plan, calibration=None).calibration == CalibrationRecord()
    with pytest.raises(OSDPError, match="'calibration.decision' must be a string"):
        replace(plan, calibration={"decision": 1})


def test_a_compiled_measurement_is_kept_and_reported(tmp_path):
    """[Note: compiled plans]: the record keeps the compiled step beside the eager one,
    the JSON round-trips, and the report says what compiling gave."""
    from osdp.planner.calibration import format_report

    plan = Plan.load(DATA / "plan-calibrated-tiebreak.json")
    record = {"scope": "blocks", "step_s": 0.25, "eager_step_s": 0.5, "first_step_s": 12.0}
    plan = replace(plan, calibration=plan.calibration.with_(compiled=record))
    assert list(plan.calibration.to_dict())[-1] == "compiled"
    again = Plan.from_dict(json.loads(_text(plan)))
    assert again.calibration.compiled == record and _text(again) == _text(plan)
    assert "compiled (blocks): step 250.00 ms measured (eager, in the measured choice, earlier: 500.00 ms); " \
           "first step (compiling) 12.0 s" in format_report(again)

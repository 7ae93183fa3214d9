"""bench/compile.py (issue 33): its ratios and targets (no processes), and a dry run end
to end on 2 gloo ranks (slow: auto mode, four wrapped models, two compiles)."""
from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"


def _bench_compile():
    """bench/compile.py as a module, with bench/ on sys.path only while importing (see
    test_bench_helpers._bench_modules) and the benches' OSDP_MEMORY_CHECK=0 not leaking."""
    check = os.environ.get("OSDP_MEMORY_CHECK")
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("bench_compile", BENCH / "compile.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
        if check is None:
            os.environ.pop("OSDP_MEMORY_CHECK", None)
        else:
            os.environ["OSDP_MEMORY_CHECK"] = check
    return module


bench = _bench_compile()


def _rows(osdp_s, osdp_c_s, fsdp_s, fsdp_c_s, batches=(4, 4, 3, 3), model_scope_s=None):
    """Rows of the eager and blocks-scope peers; the model-scope OSDP peer only where
    ``model_scope_s`` is given (``--osdp-scopes blocks`` leaves it out)."""
    times = {"osdp": (osdp_s, batches[0]), "osdp_compiled": (osdp_c_s, batches[1]), "fsdp2": (fsdp_s, batches[2]),
             "fsdp2_compiled": (fsdp_c_s, batches[3])}
    if model_scope_s is not None:
        times["osdp_compiled_model"] = (model_scope_s, batches[1])
    rows = {}
    for peer, _, scope in bench.PEERS:
        if peer not in times:
            continue
        step_s, batch = times[peer]
        rows[peer] = dict(peer=peer, batch=batch, error="", scope=scope or "")
        if step_s is not None:
            rows[peer].update(step_s=step_s, samples_per_s=batch * 2 / step_s)
        else:
            rows[peer]["error"] = "BackendCompilerFailed: boom"
    return rows


def test_targets_met_and_ratios():
    rows = _rows(1.0, 0.5, 1.0, 0.8)
    lines = bench._summarize(rows, "m")
    oc = rows["osdp_compiled"]
    assert oc["compile_speedup"] == pytest.approx(2.0)
    assert rows["fsdp2_compiled"]["compile_speedup"] == pytest.approx(1.25)
    assert oc["vs_fsdp2_compiled"] == pytest.approx((8 / 0.5) / (6 / 0.8))
    assert oc["target_met"] is True
    assert sum("NOT MET" in line for line in lines) == 0 and sum("MET" in line for line in lines) == 2


def test_the_compile_gain_is_in_samples_per_second_when_the_compiled_plan_has_another_batch():
    # compiled auto mode picked a plan at twice the batch: 1.6 s a step for 16 samples
    # against the eager plan's 1.0 s for 8 (a slower step, more samples/s)
    rows = _rows(1.0, 1.6, 1.0, 0.8, batches=(4, 8, 3, 3))
    bench._summarize(rows, "m")
    assert rows["osdp_compiled"]["compile_speedup"] == pytest.approx(1.25)


def test_compiled_memory_is_compared_by_the_allocators_bytes():
    rows = _rows(1.0, 0.5, 1.0, 0.8)
    for peer, mib in (("osdp", 100), ("osdp_compiled", 98), ("fsdp2", 120), ("fsdp2_compiled", 132)):
        rows[peer]["alloc_peak_bytes"] = mib * 2**20
    lines = bench._summarize(rows, "m")
    assert "allocator peak, compiled / eager: osdp_compiled 0.980x, fsdp2_compiled 1.100x" in lines[-2]


def test_targets_not_met_are_said_so():
    # OSDP gains less from compiling than FSDP2 and ends slower: both targets missed
    rows = _rows(1.0, 0.9, 2.0, 0.5, batches=(3, 3, 3, 3))
    lines = bench._summarize(rows, "m")
    assert rows["osdp_compiled"]["target_met"] is False
    assert sum("NOT MET" in line for line in lines) == 2
    # the gain is met but the throughput is not: the row's verdict is "not met"
    rows = _rows(1.0, 0.5, 1.0, 0.9, batches=(1, 1, 3, 3))
    lines = bench._summarize(rows, "m")
    assert rows["osdp_compiled"]["target_met"] is False
    assert sum("NOT MET" in line for line in lines) == 1


def test_each_osdp_scope_is_judged_on_its_own():
    # blocks scope slower than eager (gain 0.95x < FSDP2's 1.0x), model scope faster (1.1x)
    rows = _rows(1.0, 1.0 / 0.95, 1.0, 1.0, batches=(3, 3, 3, 3), model_scope_s=1.0 / 1.1)
    lines = bench._summarize(rows, "m")
    blocks, model = rows["osdp_compiled"], rows["osdp_compiled_model"]
    assert blocks["compile_speedup"] == pytest.approx(0.95) and blocks["target_met"] is False
    assert model["compile_speedup"] == pytest.approx(1.1) and model["target_met"] is True
    assert model["vs_fsdp2_compiled"] == pytest.approx(1.1)
    assert [("(model)" in line, "NOT MET" in line) for line in lines if "MET" in line] == [
        (False, True), (False, True), (True, False), (True, False)]


def test_a_failed_compile_is_reported_not_compared():
    rows = _rows(1.0, None, 1.0, 0.8)
    lines = bench._summarize(rows, "m")
    assert "compile_speedup" not in rows["osdp_compiled"] and "target_met" not in rows["osdp_compiled"]
    assert all("not comparable" in line for line in lines[:2])


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU smoke run; with a GPU run the bench directly")
def test_compile_bench_dry_run_writes_csv(tmp_path):
    """A tiny GPT, aot_eager (dynamo and AOTAutograd without inductor's C++ compile:
    inductor would take minutes here), 2 rounds: every peer wraps, compiles and times."""
    out = tmp_path / "compile.csv"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "compile.py"), "--dry-run", "--backend", "aot_eager", "--out", str(out),
         "--cache-dir", str(tmp_path / "profile-cache")], capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(out)))
    assert [r["peer"] for r in rows] == [p for p, _, _ in bench.PEERS]
    assert [r["scope"] for r in rows if r["peer"].startswith("osdp_compiled")] == ["blocks", "model"]
    assert all(not r["error"] and float(r["step_s"]) > 0 and int(r["batch"]) > 0 for r in rows), rows
    assert all(int(r["graph_breaks"] or 0) == 0 for r in rows if r["peer"] in bench.OSDP_COMPILED), rows
    assert "OSDP compiled (blocks) / FSDP2 compiled" in proc.stdout
    assert "OSDP compiled (model) / FSDP2 compiled" in proc.stdout


def test_break_reasons_are_the_new_ones_most_frequent_first():
    before = {"reason a": 2, "reason b": 1}
    after = {"reason a": 3, "reason b": 1, "reason\n  c": 4}
    assert bench._new_reasons(before, after) == "4x reason c | 1x reason a"
    assert bench._new_reasons(after, after) == ""

"""bench/kernels.py --dry-run runs end to end on CPU (keeps the GPU script from rotting)."""
import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the script measures for real; run it directly")
def test_bench_dry_run_writes_csv(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "kernels.py"), "--dry-run", "--groups", "2", "--no-plot",
         "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader(open(tmp_path / "kernels_cpu_dry_run.csv")))
    assert {(r["pass"], r["method"]) for r in rows} == {
        (p, m) for p in ("fwd", "dx", "dw") for m in ("cublas", "torch", "triton")}
    assert all(float(r["ms"]) > 0 for r in rows)


def test_bench_without_gpu_exits_cleanly():
    if torch.cuda.is_available():
        pytest.skip("only meaningful without a GPU")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "kernels.py")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "no CUDA device" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the script measures for real; run it directly")
def test_bench_head_ce_dry_run_writes_csv(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "kernels.py"), "--head-ce", "--dry-run", "--warmup", "0",
         "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader(open(tmp_path / "head_ce_cpu_dry_run.csv")))
    assert [(r["method"], r["slices"]) for r in rows] == [("unfused", "1"), ("fused", "1"), ("fused", "2")]
    assert all(float(r["ms"]) > 0 and float(r["peak_mib"]) > 0 for r in rows)

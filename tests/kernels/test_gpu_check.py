"""bench/gpu_check.sh: valid bash, a clear early stop without a GPU, and a dry run that
lists every step (the script itself only runs on a GPU machine)."""
import os
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def run(*args, env=None, timeout=60):
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_script_parses():
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("smi", ["missing", "lists_none"])
def test_without_gpu_it_stops_before_building(tmp_path, smi):
    if smi == "missing":
        nvidia_smi = str(tmp_path / "no-such-nvidia-smi")
    else:  # what nvidia-smi prints on a machine whose driver sees no device
        nvidia_smi = tmp_path / "nvidia-smi"
        nvidia_smi.write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
        nvidia_smi.chmod(0o755)
    out = tmp_path / "out"
    t0 = time.time()
    proc = run(str(out), env={"NVIDIA_SMI": str(nvidia_smi)})
    assert proc.returncode == 2
    assert "no NVIDIA GPU here" in proc.stderr and "--dry-run" in proc.stderr, proc.stderr
    assert not out.exists() and time.time() - t0 < 10  # nothing built, nothing written


def test_dry_run_lists_every_step_within_the_budget(tmp_path):
    proc = run("--dry-run", str(tmp_path / "out"), env={"NVIDIA_SMI": "/nonexistent"})
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for needle in ["OSDP_SKIP_CUDA=0", "pip install -e '.[test]'", "pytest -m gpu", "bench/kernels.py",
                   "--budget-s", "bench/fidelity.py", "osdp_kernels.aot --arch sm_80,sm_90", "--json",
                   str(tmp_path / "out")]:
        assert needle in text, f"{needle!r} missing from the dry run:\n{text}"
    caps = [int(c) for c in __import__("re").findall(r"\(cap\s+(\d+) s\)", text)]
    assert len(caps) == 7 and sum(caps) <= 540  # the steps' caps fit the 9-minute budget
    assert not (tmp_path / "out").exists()


def test_steps_run_in_order_and_failures_are_summarized(tmp_path):
    """The orchestration on a pretend GPU machine: nvidia-smi and python are stand-ins that
    print their arguments; the kernel benchmark's stand-in fails."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: Pretend H100 (UUID: GPU-0)'\n")
    py = tmp_path / "python"
    py.write_text('#!/bin/sh\necho "python $*"\ncase "$*" in *bench/kernels.py*) exit 3;; esac\nexit 0\n')
    smi.chmod(0o755)
    py.chmod(0o755)
    out = tmp_path / "out"
    proc = run(str(out), env={"NVIDIA_SMI": str(smi), "PYTHON": str(py), "GPU_CHECK_BUDGET_S": "60"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = (out / "summary.txt").read_text().splitlines()
    steps = {line.split()[0]: line.split()[1] for line in summary[1:] if not line.startswith("total")}
    assert steps == {"build": "0", "cuda_visible": "0", "gpu_tests": "0", "kernels": "3", "fidelity": "0", "compile": "0",
                     "aot": "0"}
    assert "pytest -m gpu" in (out / "gpu_tests.log").read_text()
    assert f"--out-dir {out}" in (out / "kernels.log").read_text()
    assert "--world-size 1" in (out / "fidelity.log").read_text()
    assert f"--json {out}/aot.json" in (out / "aot.log").read_text()
    assert "compile.py --quick --world-size 1" in (out / "compile.log").read_text()
    assert (out / "all.tgz").exists()
    for name in ("env.txt", "nvidia-smi.txt", "nvidia-smi-q.txt", "nvidia-smi-after.txt", "build.log"):
        assert (out / name).exists(), name

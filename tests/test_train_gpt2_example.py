"""examples/train_gpt2.py end to end under torchrun (2 gloo ranks): auto mode on a stock
GPT2LMHeadModel, two AdamW groups by original parameter name, global gradient
clipping, gradient accumulation, sharded checkpoints and a resume that continues
exactly where the uninterrupted run went, and a clean exit (code 0)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import osdp

REPO = Path(osdp.__file__).resolve().parent.parent  # the osdp this test imported
SCRIPT = REPO / "examples" / "train_gpt2.py"

pytestmark = pytest.mark.slow


def _torchrun(cwd: Path, *flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", str(SCRIPT),
           "--cache-dir", str(cwd / "cache"), *flags]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(cmd)} exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_train_gpt2_runs_and_resumes_where_it_stopped(tmp_path):
    pytest.importorskip("transformers")
    common = ["--steps", "6", "--save-every", "3", "--micro-batch", "2", "--global-batch", "8", "--max-norm", "0.5"]
    full = _torchrun(tmp_path, *common, "--ckpt-dir", "full", "--metrics", "full.jsonl")
    log = full.stderr
    assert "model: Hugging Face GPT-2" in log
    assert "micro-batch 2 x 2 accumulation steps per rank" in log
    assert "without" in log and "AdamW: " in log
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["step_000003", "step_000006"]
    run = _metrics(tmp_path / "full.jsonl")
    assert [r["step"] for r in run] == [1, 2, 3, 4, 5, 6]
    assert run[-1]["loss"] < run[0]["loss"] - 0.1, "the loss falls"
    assert all(r["grad_norm"] > 0.5 for r in run), "every step's global norm is above --max-norm: clipping acts"

    # resume from the step-3 checkpoint in a fresh directory: steps 4..6 again
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "full" / "step_000003", tmp_path / "resumed" / "step_000003")
    resumed = _torchrun(tmp_path, *common, "--ckpt-dir", "resumed", "--resume", "--metrics", "resumed.jsonl")
    assert "resumed from resumed/step_000003 (step 3)" in resumed.stderr
    again = _metrics(tmp_path / "resumed.jsonl")
    assert [r["step"] for r in again] == [4, 5, 6]
    for a, b in zip(again, run[3:]):
        # same data, restored weights and AdamW state: the same numbers (the plan may
        # differ between the runs only through timing noise: summation order)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert (tmp_path / "resumed" / "step_000006").is_dir()


def test_train_gpt2_with_osdps_own_gpt(tmp_path):
    """The path taken without transformers (``--model osdp``: osdp.models.GPT)."""
    done = _torchrun(tmp_path, "--model", "osdp", "--steps", "3", "--save-every", "3", "--ckpt-dir", "ckpt",
                     "--metrics", "m.jsonl")
    assert "model: osdp.models GPT-2" in done.stderr
    run = _metrics(tmp_path / "m.jsonl")
    assert [r["step"] for r in run] == [1, 2, 3] and run[-1]["loss"] < run[0]["loss"]
    assert (tmp_path / "ckpt" / "step_000003").is_dir()

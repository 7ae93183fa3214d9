"""The layering DESIGN.md asks for: the planner never imports the runtime, split ops
never import the runtime, and both meet in ``osdp.contract``. Checked in a fresh
interpreter (importing a module here would see what earlier tests imported)."""
from __future__ import annotations

import subprocess
import sys

import pytest

PLANNER = ["osdp.planner." + m for m in (
    "description", "gpt_desc", "checks", "cluster", "run", "device", "cost_model", "search", "search_problem",
    "batch_sweep", "plan", "planner", "step_sim", "rerank", "inputs", "calibration", "profile_cache", "uniform_plan",
    "fake_describe", "collective_cost", "llama_desc",
)]


@pytest.mark.parametrize("modules,forbidden", [
    (PLANNER, "osdp.runtime"),
    # the hardware micro-benchmark (torch collectives and compute) is osdp.profiler's
    (["osdp.planner"] + PLANNER, "osdp.profiler"),
    (["osdp.ops", "osdp.ops.matmul_split", "osdp.ops.split_embedding"], "osdp.runtime"),
    (["osdp.contract"], "osdp.planner"),
    # Triton (about 80 MiB resident) is imported by the first CUDA slice matmul, not by the
    # planner or the wrapper (issue 34)
    (["osdp", "osdp.planner.planner", "osdp.runtime", "osdp.ops"], "triton"),
])
def test_layering(modules, forbidden):
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + f"bad = sorted(m for m in sys.modules if m == {forbidden!r} or m.startswith({forbidden + '.'!r}))\n"
        + "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"{modules} import {out.stdout.strip()}"

"""Batch scheduler, Plan storage and the `osdp` CLI."""
import json

import numpy as np
import pytest

import osdp
from osdp.cli import main
from osdp.errors import InfeasiblePlanError, OSDPError, PlanMismatchError
from osdp.models import GPTConfig
from osdp.planner.cluster import load_cluster
from osdp.planner.cost_model import PlannerSettings, build_template
from osdp.planner.gpt_desc import describe_gpt
from osdp.planner.plan import Plan
from osdp.planner.planner import make_plan
from osdp.planner.run import RunSettings
from osdp.planner.batch_sweep import (fits_at, least_memory_problem, memory_pareto_options, rep_family, schedule,
                                    search_batch)
from osdp.sizes import format_bytes

MiB = 2**20
TINY = GPTConfig(vocab_size=256, seq_len=32, num_layers=3, hidden=64, heads=4)


def small_device(limit_mib=48, world=4):
    cluster = load_cluster("titan-rtx-pcie3").with_(constant_bytes=0)
    return cluster.for_run(RunSettings(world_size=world, memory_limit_bytes=limit_mib * MiB))


# the brute-force reference at 48 MiB (most rep sets x batches fit) with the slow tests,
# about 7 s without checkpointing and 18 s with it; the default run keeps the same
# comparison at 24 MiB, with and without checkpointing
@pytest.mark.parametrize("ckpt,limit_mib", [
    ("none", 24), ("auto", 24), pytest.param("none", 48, marks=pytest.mark.slow),
    pytest.param("auto", 48, marks=pytest.mark.slow)], ids=["24-none", "24-auto", "48-none", "48-auto"])
def test_sweep_finds_the_best_samples_per_second_over_every_batch(ckpt, limit_mib):
    desc = describe_gpt(TINY)
    dev = small_device(limit_mib)
    settings = PlannerSettings(checkpointing=ckpt, max_slices=4)
    best = schedule(desc, dev, settings, backend="python")
    # reference: for every rep set of the family ([Note: rep family]; the first is no
    # rep unit), search every batch until nothing fits, keep the most samples/s
    rates = {}
    for member in rep_family(desc, settings):
        t = build_template(desc, dev, member)
        b = 1
        while True:
            r = search_batch(t, b, "python")
            if not r.feasible:
                break
            rates[(member.rep_units, b)] = b / r.time_s
            b += 1
    assert rates, "the reference found nothing; the instance is too tight"
    top = max(rates, key=rates.get)
    assert (best.template.rep_units, best.batch) == (top[0], top[1])
    assert best.samples_per_s == pytest.approx(rates[top] * dev.world_size, rel=1e-12)
    assert best.estimate.fits and best.estimate.peak_bytes <= dev.memory_limit_bytes


def test_feasibility_agrees_with_the_full_search():
    desc = describe_gpt(TINY)
    for limit in (10, 16, 24, 40):
        t = build_template(desc, small_device(limit), PlannerSettings(checkpointing="auto", max_slices=4))
        for b in (1, 2, 5, 9, 17):
            assert fits_at(t, b, "python") == search_batch(t, b, "python").feasible


@pytest.mark.xfail(strict=True, reason="least_memory_problem lays its option ranges out per (op, variant), but "
                   "the chosen options come in the template's order (per segment: every op's variant 0, then "
                   "variant 1), so a checkpointable block of several ops gets other ops' options; fits_at "
                   "then misjudges some batches (tiny at 600 MiB: 212 fits, fits_at says not)")
def test_least_memory_problem_keeps_each_ops_own_options():
    t = build_template(describe_gpt(TINY), small_device(24), PlannerSettings(checkpointing="auto", max_slices=4))
    full, least = t.problem(2), least_memory_problem(t, 2)
    chosen = memory_pareto_options(t, 2)
    for i in range(len(t.desc.ops)):
        for v in range(2):
            own = chosen[(t.opt_op[chosen] == i) & (t.opt_variant[chosen] == v)]
            got = least.opt_held_q[least.opt_begin[i, v]:least.opt_end[i, v]]
            assert np.array_equal(got, full.opt_held_q[own]), (t.desc.ops[i].name, v)


def test_infeasible_plan_error_names_the_minimum_memory():
    desc = describe_gpt(TINY)
    with pytest.raises(InfeasiblePlanError) as info:
        schedule(desc, small_device(1), PlannerSettings(), backend="python")
    err = info.value
    assert err.min_bytes > 1 * MiB
    # sizes in the unit that fits them: the 1 MiB limit is not "0.00 GiB"
    assert str(err).startswith("no plan fits in 1.00 MiB per device at batch 1")
    needs = sum(err.breakdown.values())
    assert f"needs {format_bytes(needs)}," in str(err)
    assert f"fits in a limit of {format_bytes(err.min_bytes)};" in str(err)
    assert needs < err.min_bytes
    # the limit it states fits (the least-memory plan's peak at the limit asked for did not:
    # the prefetch window and the memory quanta grow with the limit), at any budget asked
    for asked in (0.25, 1):
        with pytest.raises(InfeasiblePlanError) as info:
            schedule(desc, small_device(asked), PlannerSettings(), backend="python")
        stated = info.value.min_bytes
        assert schedule(desc, small_device(stated / MiB), PlannerSettings(), backend="python").batch >= 1


def test_plan_round_trips_and_rejects_another_model(tmp_path):
    desc = describe_gpt(TINY)
    plan = make_plan(desc, small_device(), PlannerSettings(max_slices=4), backend="python")
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path, fingerprint=desc.fingerprint())
    assert loaded == plan
    assert loaded.plan_hash() == plan.plan_hash()
    other = describe_gpt(GPTConfig(vocab_size=256, seq_len=32, num_layers=2, hidden=64, heads=4))
    with pytest.raises(PlanMismatchError, match="fingerprint"):
        Plan.load(path, fingerprint=other.fingerprint())
    with pytest.raises(PlanMismatchError, match="world size"):
        plan.check_model(desc.fingerprint(), world_size=2)
    data = json.loads(path.read_text())
    data["version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(OSDPError, match="version"):
        Plan.load(path)
    path.write_text("{")
    with pytest.raises(OSDPError, match="not valid JSON"):
        Plan.load(path)


def test_plan_predictions_and_baselines_are_consistent():
    desc = describe_gpt(TINY)
    plan = make_plan(desc, small_device(), PlannerSettings(max_slices=4), backend="python")
    assert set(plan.baselines) == {"fsdp", "shard_grad_op", "ddp"}
    # the OSDP search space contains the FSDP and the DDP plan at every batch: never slower
    for name in ("fsdp", "ddp"):
        assert plan.predicted.samples_per_s >= plan.baselines[name].samples_per_s * (1 - 1e-12)
    modes = plan.unit_modes()
    assert set(modes) == {op.name for op in desc.ops}
    # rep only on whole units ([Note: replicated units] in osdp/contract.py)
    assert all(set(m) <= {"dp", "zdp"} or m == ("rep",) for m in modes.values())
    text = str(plan)
    assert "FSDP full shard" in text and "DDP (all rep)" in text and "samples/s" in text


def test_cli_plan_writes_json_and_shows_it(tmp_path, capsys):
    out = tmp_path / "p.json"
    args = ["plan", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "256",
            "--world-size", "4", "--memory", "1GiB", "--max-slices", "4", "--backend", "python", "--json", str(out)]
    assert main(args) == 0
    shown = capsys.readouterr().out
    assert "speedup over FSDP" in shown or "FSDP (full shard) does not fit" in shown
    saved = json.loads(out.read_text())
    assert saved["search_s"] > 0
    assert main(["plan", "--plan", str(out)]) == 0


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["plan", "--preset", "nope"], "unknown model preset"),
        (["plan", "--preset", "tiny", "--memory", "8XB"], "cannot read memory size"),
        (["plan", "--preset", "tiny", "--memory", "1KiB"], "no plan fits"),
        (["plan", "--preset", "tiny", "--batch", "0"], "--batch"),
        (["plan", "--preset", "tiny", "--world-size", "0"], "--world-size"),
        (["plan", "--layers", "2", "--hidden", "65", "--heads", "4"], "not divisible"),
        (["plan", "--plan", "/nonexistent/plan.json"], "does not exist"),
        (["plan", "--cluster", "nowhere"], "unknown cluster"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("osdp: error:") and needle in err
    assert "\n" not in err and "Traceback" not in err


def test_public_api_names_resolve():
    for name in osdp.__all__:
        if name != "__version__":
            assert getattr(osdp, name) is not None


def test_global_batch_picks_the_fastest_micro_batch_split():
    desc = describe_gpt(TINY)
    dev = small_device(20)
    settings = PlannerSettings(max_slices=4)
    best = schedule(desc, dev, settings, backend="python", global_batch=4 * 12)
    assert best.batch * best.accumulation_steps == 12
    # reference: every divisor of the per-rank share and every rep set of the family
    # ([Note: rep family]), searched directly
    times = {}
    for micro in (1, 2, 3, 4, 6, 12):
        for member in rep_family(desc, settings.with_(accumulation_steps=12 // micro)):
            r = search_batch(build_template(desc, dev, member), micro, "python")
            if r.feasible:
                times[(micro, member.rep_units)] = r.time_s
    top = min(times, key=times.get)
    assert (best.batch, best.template.rep_units) == top
    assert best.samples_per_s == pytest.approx(48 / times[top], rel=1e-12)
    with pytest.raises(OSDPError, match="multiple of the world size"):
        schedule(desc, dev, settings, backend="python", global_batch=10)

"""The benches' measuring helpers: the largest fitting batch (secant probes) against a
brute-force scan, and the physical-limit pieces (local stand-ins for collectives, the
recorded collectives of a step) on 2 gloo ranks."""
from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest
import torch

from runtime.dist_harness import spawn

BENCH = str(Path(__file__).resolve().parent.parent / "bench")


def _bench_modules():
    """bench/common.py, physical_limit.py, regret.py and population_fidelity.py, imported with bench/ on sys.path only
    while importing (left on it, bench/kernels.py would shadow the ``kernels`` package
    that transformers looks for), and without the benches' OSDP_MEMORY_CHECK=0 leaking
    into the other tests of this process."""
    check = os.environ.get("OSDP_MEMORY_CHECK")
    sys.path.insert(0, BENCH)
    try:
        import common
        import physical_limit
        import population_fidelity
        import regret
    finally:
        sys.path.remove(BENCH)
        if check is None:
            os.environ.pop("OSDP_MEMORY_CHECK", None)
        else:
            os.environ["OSDP_MEMORY_CHECK"] = check
    return common, physical_limit, regret, population_fidelity


common, _, regret_bench, population_fidelity = _bench_modules()


def _largest_fitting(peaks, budget, max_batch, monkeypatch):
    probes = []

    def measured(model, optim, config, b, **_):
        probes.append(b)
        return peaks(b)

    monkeypatch.setattr(common, "measured_peak_bytes", measured)
    model = torch.nn.Linear(1, 1)
    return common.largest_fitting_batch_of(model, None, budget, max_batch), probes


def test_largest_fitting_batch_equals_a_scan_of_every_batch(monkeypatch):
    rng = random.Random(0)
    for _ in range(500):
        base, per_sample = rng.uniform(10, 100), rng.uniform(0.1, 5)
        curve = rng.choice([0.0, 0.01, 0.1])  # the peak op can change with the batch
        max_batch = rng.choice([1, 8, 32, 128, 256])
        budget = rng.uniform(base - 5, base + per_sample * 300)
        peaks = lambda b, base=base, s=per_sample, c=curve: base + s * b + c * b * b  # noqa: E731
        (batch, peak), probes = _largest_fitting(peaks, budget, max_batch, monkeypatch)
        want = max((b for b in range(1, max_batch + 1) if peaks(b) <= budget), default=0)
        assert batch == want, (budget, max_batch, probes)
        assert peak == peaks(max(batch, 1))
        # the answer is proven: b fits and b + 1 was measured not to (or b is the cap)
        assert want == 0 or want == max_batch or want + 1 in probes
        assert len(probes) <= 16


def test_largest_fitting_batch_probes_few_batches_on_a_linear_peak(monkeypatch):
    (batch, _), probes = _largest_fitting(lambda b: 1000 + 37 * b, 1000 + 37 * 21.5, 32, monkeypatch)
    assert batch == 21
    assert len(probes) <= 5, probes  # bisection from 1 to 32 takes 8


def _physical_limit_worker(rank, world):
    import osdp
    from osdp.models import GPT, GPTConfig
    from osdp.runtime import collectives

    common, limits, _, _ = _bench_modules()
    local_collectives, physical_limit = limits.local_collectives, limits.physical_limit
    recorded_collectives = limits.recorded_collectives

    originals = collectives.all_gather_flat

    config = GPTConfig(vocab_size=64, seq_len=16, num_layers=2, hidden=32, heads=2)
    torch.manual_seed(0)
    model = osdp.OSDP(GPT(config), default_mode="zdp", memory_check=False, timeout_s=2.0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    common.train_step(model, optim, config, 2, seed=0)
    first, second = [], []
    with recorded_collectives(first):
        common.train_step(model, optim, config, 2, seed=1)
    with recorded_collectives(second):
        common.train_step(model, optim, config, 2, seed=2)
    # under the stand-ins the step talks to no one: rank 0 steps alone while rank 1
    # waits at a barrier; a real collective would find no peer and time out (2 s)
    loss = None
    if rank == 0:
        with local_collectives():
            loss = common.train_step(model, optim, config, 2, seed=3)
    torch.distributed.barrier()
    limit = physical_limit(model, optim, config, 2, rounds=2)
    return dict(first=[(n, s) for n, s, _, _ in first], second=[(n, s) for n, s, _, _ in second],
                loss=loss, limit=limit, restored=collectives.all_gather_flat is originals)


def test_physical_limit_records_a_steps_collectives_and_runs_the_step_without_them():
    results = spawn(_physical_limit_worker, 2)
    for r in results:
        assert r["first"], "a zdp step issues collectives"
        assert r["first"] == r["second"]  # the same collectives, sizes and order every step
        kinds = {name for name, _ in r["first"]}
        assert "all_gather_flat" in kinds
        assert r["restored"]  # the runtime's entry points are its own again
        limit = r["limit"]
        assert limit["collectives"] == len(r["first"])
        assert limit["step_s"] > 0 and limit["compute_only_s"] > 0 and limit["comm_only_s"] > 0
        assert limit["ratio"] == pytest.approx(limit["step_s"] / max(limit["compute_only_s"], limit["comm_only_s"]))
    assert results[0]["first"] == results[1]["first"]  # every rank issues the same sequence
    assert results[0]["loss"] == pytest.approx(results[0]["loss"]) and abs(results[0]["loss"]) < 1e3  # finite


def test_regret_leaves_out_a_finalist_that_runs_the_picks_own_configuration():
    """Pick 50/s; a finalist running the pick's configuration measured 55/s (timing
    noise of one plan), another 52/s, a faster one over the budget: regret 52/50 - 1."""
    budget = 100
    rows = [dict(plan="pick", is_pick=True, batch=4, peak_bytes=90, samples_per_s=50.0, interleaved=True),
            dict(plan="twin", is_pick=False, batch=4, peak_bytes=90, samples_per_s=55.0, interleaved=True,
                 same_as_pick=True),
            dict(plan="other", is_pick=False, batch=5, peak_bytes=99, samples_per_s=52.0, interleaved=True),
            dict(plan="over", is_pick=False, batch=9, peak_bytes=101, samples_per_s=90.0, interleaved=True)]
    value, best = regret_bench.regret(rows, budget)
    assert best == "other" and value == pytest.approx(52 / 50 - 1)
    rows[1]["same_as_pick"] = False  # another plan after all: it is the best alternative
    assert regret_bench.regret(rows, budget) == (pytest.approx(55 / 50 - 1), "twin")


def test_regret_csv_gives_samples_per_s_only_where_regret_compares_it():
    """A plan timed only in the first pass keeps that value in first_pass_samples_per_s
    and leaves samples_per_s empty, so a scan of the CSV compares what regret() does;
    the pick and finalists keep their interleaved values; a cell without a final round
    is left as measured."""
    rows = [dict(plan="pick", is_pick=True, batch=4, samples_per_s=50.0, interleaved=True,
                 first_pass_samples_per_s=49.0),
            dict(plan="finalist", is_pick=False, batch=5, samples_per_s=52.0, interleaved=True,
                 first_pass_samples_per_s=51.0),
            dict(plan="first_pass_only", is_pick=False, batch=6, samples_per_s=58.0),
            dict(plan="no_batch", is_pick=False, batch=0, samples_per_s=0.0)]
    out = {r["plan"]: r for r in regret_bench.csv_rows(rows)}
    assert (out["pick"]["samples_per_s"], out["finalist"]["samples_per_s"]) == (50.0, 52.0)
    assert out["finalist"]["first_pass_samples_per_s"] == 51.0
    assert out["first_pass_only"]["samples_per_s"] == "" and out["first_pass_only"]["first_pass_samples_per_s"] == 58.0
    assert out["no_batch"]["samples_per_s"] == 0.0
    assert rows[2]["samples_per_s"] == 58.0  # the bench's own rows are not changed
    unranked = [dict(r, interleaved=False) for r in rows]
    assert [r["samples_per_s"] for r in regret_bench.csv_rows(unranked)] == [50.0, 52.0, 58.0, 0.0]


def _population_plan_worker(rank, world):
    import osdp
    from osdp.models import GPT, GPTConfig
    from osdp.planner.cluster import DEFAULT_CLUSTER, load_cluster
    from osdp.planner.cost_model import PlannerSettings
    from osdp.planner.gpt_desc import describe_gpt
    from osdp.planner.run import RunSettings
    from osdp.planner.uniform_plan import uniform_plan

    _, _, regret, population_fidelity = _bench_modules()
    config = GPTConfig(vocab_size=64, seq_len=8, num_layers=2, hidden=32, heads=2)
    device = load_cluster(DEFAULT_CLUSTER).for_run(RunSettings(world_size=world, memory_limit_bytes=1 << 30))
    desc = describe_gpt(config)
    torch.manual_seed(0)
    kwargs = {**regret.population(GPT(config)), **regret.reserve(GPT(config))}
    out = {}
    for name in ("all_rep", "random3", "dp_first_half", "random201_ckpt"):
        torch.manual_seed(0)
        runs = osdp.OSDP(GPT(config), **kwargs[name], memory_check=False)
        base = uniform_plan(desc, device, PlannerSettings(), 2, checkpointed="ckpt" in name)
        plan = population_fidelity._as_plan(base, kwargs[name], runs.prefetch_bytes)
        out[name] = ({u.name: u.modes[0] for u in plan.units}, runs.unit_modes(), plan.prefetch_bytes,
                     runs.prefetch_bytes, plan.checkpoint_blocks, tuple(runs.checkpoint_blocks))
    return out


def test_population_fidelity_prices_the_modes_and_window_regret_runs():
    """A regret population plan as a Plan (``_as_plan``): per unit the modes that
    osdp.OSDP(**kwargs) resolves for it, and the window it runs."""
    found = spawn(_population_plan_worker, 2)[0]
    for name, (planned, run, planned_window, run_window, planned_blocks, run_blocks) in found.items():
        assert planned == run, name
        assert planned_window == run_window, name
        assert planned_blocks == run_blocks, name
    assert len(set(found["dp_first_half"][0].values())) == 2  # both modes
    assert len(set(found["random201_ckpt"][0].values())) == 2
    assert found["random201_ckpt"][5] == ("blocks.0", "blocks.1")  # a reserve plan checkpoints every block


def test_a_cell_short_of_fitting_plans_is_counted_without_the_pick():
    """``fitting``: population rows with a batch whose measured peak is within the
    budget; the pick and plans with no fitting batch do not count."""
    rows = [dict(plan="pick", is_pick=True, batch=4, peak_bytes=90),
            dict(plan="a", is_pick=False, batch=3, peak_bytes=100),
            dict(plan="b", is_pick=False, batch=0, peak_bytes=120),
            dict(plan="c", is_pick=False, batch=2, peak_bytes=101)]
    assert regret_bench.fitting(rows, 100) == 1
    assert regret_bench.fitting(rows, 101) == 2


HF_WORKLOADS = {
    "mixtral": (dict(model_class="MixtralForCausalLM", config_class="MixtralConfig", seq_len=8),
                dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16),
                ("osdp", "fsdp_zero3", "ddp")),
    # experts called only when routed some token: OSDP with leaf modules, DDP finding unused ones
    "switch": (dict(model_class="SwitchTransformersForConditionalGeneration", config_class="SwitchTransformersConfig",
                    seq_len=8, block_lists=("encoder.block", "decoder.block"), leaves=("SwitchTransformersSparseMLP",)),
               dict(vocab_size=64, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_decoder_layers=2,
                    num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, num_heads=4, num_experts=4,
                    expert_capacity=64, router_jitter_noise=0.0, dropout_rate=0.0, decoder_start_token_id=0,
                    pad_token_id=0),
               ("osdp", "ddp")),
}


def _hf_workload_worker(rank, world, name):
    """One step of each peer on a stock MoE (bench/moe.py's workloads, tiny), against the
    plain model's loss on the same tokens."""
    shape, config, peers = HF_WORKLOADS[name]
    workload = common.HFWorkload(**shape, **config)
    torch.manual_seed(0)
    with torch.no_grad():
        want = workload.forward(workload.build(), 2, seed=5).loss.item()
    losses = {}
    for peer in peers:
        model = common.wrap_peer(peer, workload)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
        losses[peer] = common.train_step(model, optim, workload, 2, seed=5)
        if peer == "osdp" and workload.leaves:
            assert model.unit_names().count("encoder.block.1.layer.1.mlp") == 1  # a leaf: one unit
    return want, losses


@pytest.mark.parametrize("name", sorted(HF_WORKLOADS))
def test_hf_workload_steps_every_peer_on_the_stock_model(name):
    pytest.importorskip("transformers")
    for want, losses in spawn(_hf_workload_worker, 2, name):
        assert losses == pytest.approx({peer: want for peer in losses}, rel=1e-5)

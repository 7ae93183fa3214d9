"""``rep`` units (replicated, DDP per unit; contract.py [Note: replicated units]) on 2
gloo ranks, against references: single-process training on the whole global batch,
torch DDP (all-rep), FSDP2 and autocast (mixed precision), one big batch (gradient
accumulation), and checkpoints of other plans.

Expectations are written here from the contract: a rep unit is never all-gathered nor
reduce-scattered; its gradient goes into a bucket that is all-reduced (one collective
over every rank) once it holds >= REPLICATE_BUCKET_BYTES and at the end of the backward
pass, at most MAX_INFLIGHT_REPLICATE_BUCKETS in flight. Bucket sizes and ledger peaks
below are computed by hand for the test models. Tolerances as test_parity.py (fp32,
AdamW eps=1e-5): losses rtol 1e-5, parameters rtol/atol 1e-5; mixed precision as
test_features.py.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from osdp.contract import MAX_INFLIGHT_REPLICATE_BUCKETS, REPLICATE_BUCKET_BYTES

from . import feature_cases as fc
from . import parity_cases as pc
from . import rep_cases as rc
from . import training_loop_cases as tc
from .dist_harness import spawn

WORLD = 2
_RESULTS: dict = {}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if "out" not in _RESULTS:
        _RESULTS["out"] = spawn(rc.run_all, WORLD, str(tmp_path_factory.mktemp("rep_ckpt")))
    return _RESULTS["out"]


def _modes_of(name):
    """unit -> mode as the case gives it (slices ``name[i]``), written out from rep_cases."""
    key, kwargs = rc.CASES[name]
    from osdp.runtime.config import unit_candidates

    default = kwargs.get("default_mode", "zdp")
    out = {}
    for unit in unit_candidates(pc.make_model(key)):
        mode = kwargs.get("modes", {}).get(unit, default)
        if key == "tied" and unit == "lm_head":
            continue  # the tied use owns no unit
        if isinstance(mode, tuple):
            out.update({f"{unit}[{i}]": m for i, m in enumerate(mode)})
        else:
            out[unit] = mode
    return out


def _trained(name):
    """Units of the case that get gradients (not frozen)."""
    key = rc.CASES[name][0]
    frozen = rc.FROZEN.get(key, lambda unit: False)
    return {u for u in _modes_of(name) if not frozen(u)}


def _assert_states_close(state, ref, what):
    assert list(state) == list(ref), f"{what}: keys differ"
    for key in ref:
        torch.testing.assert_close(state[key], ref[key], rtol=1e-5, atol=1e-5, msg=lambda m: f"{what} {key}: {m}")


def _assert_states_equal(a, b, what, ordered=True):
    assert (list(a) == list(b)) if ordered else (sorted(a) == sorted(b)), f"{what}: keys differ"
    for key in a:
        assert a[key].shape == b[key].shape and torch.equal(a[key], b[key]), f"{what}: {key} differs"


# ---- parity ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(rc.CASES))
def test_training_matches_single_process(results, name):
    key = rc.CASES[name][0]
    ref_losses, ref_state = results[0]["ref"][key]
    for rank in range(WORLD):
        losses, state, probe = results[rank]["osdp"][name]
        assert probe["unit_modes"] == _modes_of(name)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        _assert_states_close(state, ref_state, f"rank {rank}")
    initial = pc.make_model(key).state_dict()
    assert max((state[k] - initial[k]).abs().max().item() for k in ref_state) > 1e-2  # it trained


@pytest.mark.parametrize("name", list(rc.CASES))
def test_replicas_stay_identical(results, name):
    a, b = (results[r]["osdp"][name][2] for r in range(WORLD))
    assert set(a["rep_shards_end"]) == {u for u, m in _modes_of(name).items() if m == "rep"}
    for unit, shard in a["rep_shards_end"].items():
        assert torch.equal(shard, b["rep_shards_end"][unit]), unit
        trained = not torch.equal(shard, a["rep_shards"][unit])
        assert trained is (unit in _trained(name)), f"{unit} trained: {trained}"


def test_all_rep_matches_ddp(results):
    """Same local batches, same sums of two ranks, divided by 2 (exact): DDP's numbers."""
    ddp_losses, ddp_state = results[0]["ddp"]
    losses, state, _ = results[0]["osdp"]["all_rep"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ddp_losses), rtol=1e-6, atol=0)
    _assert_states_close(state, ddp_state, "vs DDP")


# ---- what a rep unit is -----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["all_rep", "mix", "tied_mix"])
def test_rep_parameters_are_whole_with_original_shapes(results, name):
    key = rc.CASES[name][0]
    shapes = {n: tuple(p.shape) for n, p in pc.make_model(key).named_parameters()}
    modes = _modes_of(name)
    for rank in range(WORLD):
        probe = results[rank]["osdp"][name][2]
        for pname, shape in probe["param_shapes"].items():
            unit = pname.rsplit(".", 1)[0] if "[" not in pname else None
            if unit is not None and modes.get(unit) == "rep":
                assert shape == shapes[pname], pname  # whole, as in the plain model
            elif unit is not None:
                assert len(shape) == len(shapes[pname]) and shape[1:] == (1,) * (len(shape) - 1), pname  # a piece
        for unit, mode in modes.items():
            if mode == "rep":  # no padding: a shard group of one
                assert probe["padded"][unit] == probe["numels"][unit], unit


@pytest.mark.parametrize("name", [n for n in rc.CASES if n != "mix_no_coalesce"])
def test_ledger_rep_units_never_gathered_one_bucket_all_reduce(results, name):
    modes, trained = _modes_of(name), _trained(name)
    rep = {u for u, m in modes.items() if m == "rep"}
    for rank in range(WORLD):
        probe = results[rank]["osdp"][name][2]
        assert not rep & set(probe["all_gathers"]), "a rep unit was gathered"
        assert not rep & set(probe["reduce_scatters"]), "a rep unit was reduce-scattered"
        # every trained rep unit's gradient rode in exactly one bucket all-reduce per step
        # (the tied wte too: both uses summed first); a frozen one in none
        assert probe["all_reduces"] == {u: 1 for u in rep & trained}
        for unit, mode in modes.items():
            if mode != "rep" and not unit.startswith("wte["):
                assert probe["reduce_scatters"].get(unit) == (1 if unit in trained else None), unit
        # kept after forward: dp units awaiting their backward, never rep units
        assert set(probe["gathered_after_forward"]) == {u for u, m in modes.items() if m == "dp"}
        assert probe["gathered_after_backward"] == [] and probe["grad_bytes_after_backward"] == 0
        for pname in probe["param_shapes"]:
            unit = next(u for u in modes if pname.startswith(u + ".") or pname.startswith(u.split("[")[0] + "."))
            assert (pname in probe["grad_flags"]) is (unit in trained), pname
            if pname in probe["grad_flags"]:
                flags = (True, False) if modes[unit] == "rep" else (False, True)  # (replicated, sharded)
                assert probe["grad_flags"][pname] == flags, pname


def test_collectives_of_a_mixed_plan_one_by_one(results):
    """Without coalescing every collective is one unit's, except the rep bucket: per step
    dp 1 all-gather, zdp 2, each sharded unit's gradient one all-reduce of its padded
    buffer (gloo: contract.gradient_collective), and ONE all-reduce of all rep units'
    gradients together (their total is far below REPLICATE_BUCKET_BYTES)."""
    modes = _modes_of("mix_no_coalesce")
    for rank in range(WORLD):
        probe = results[rank]["osdp"]["mix_no_coalesce"][2]
        padded, numels = probe["padded"], probe["numels"]
        rep_total = sum(numels[u] for u, m in modes.items() if m == "rep")
        assert rep_total * 4 < REPLICATE_BUCKET_BYTES
        expected = Counter()
        for unit, mode in modes.items():
            if mode == "rep":
                continue
            gathers = 1 if mode == "dp" else 2
            expected[("all_gather", (0, 1), padded[unit])] += gathers
            expected[("all_reduce", (0, 1), padded[unit])] += 1
        expected[("all_reduce", (0, 1), rep_total)] += 1
        assert Counter(probe["calls"]) == expected


@pytest.mark.parametrize("name", ["mix", "mix_checkpoint", "mix_streams"])
def test_rep_units_never_ride_in_coalesced_collectives(results, name):
    """With coalescing on: exactly one all-reduce carries rep gradients (all of them), and
    the gathered / reduced elements are exactly the sharded units' (rep units in none)."""
    modes = _modes_of(name)
    for rank in range(WORLD):
        probe = results[rank]["osdp"][name][2]
        padded, numels = probe["padded"], probe["numels"]
        rep_total = sum(numels[u] for u, m in modes.items() if m == "rep")
        sharded = {u for u, m in modes.items() if m != "rep"}
        reduces = [n for op, ranks, n in probe["calls"] if op == "all_reduce"]
        assert reduces.count(rep_total) == 1
        assert sum(reduces) == rep_total + sum(padded[u] for u in sharded)
        gathered = sum(n for op, _, n in probe["calls"] if op == "all_gather")
        assert gathered == sum(padded[u] * probe["all_gathers"][u] for u in sharded)
        if name != "mix_checkpoint":
            assert len(reduces) < len(sharded) + 1  # small sharded units did coalesce


def test_all_rep_issues_no_gather_and_one_all_reduce_per_step(results):
    total = sum(p.numel() for p in pc.make_model("uneven").parameters())
    assert total * 4 < REPLICATE_BUCKET_BYTES  # one bucket, issued at the end of backward
    for rank in range(WORLD):
        assert results[rank]["osdp"]["all_rep"][2]["calls"] == [("all_reduce", (0, 1), total)]


# ---- the bucket rule ----------------------------------------------------------------------
L = rc.STACK_WIDTH * rc.STACK_WIDTH + rc.STACK_WIDTH  # one Linear(512, 512): 262,656 parameters
N = 2 * rc.STACK_WIDTH  # the LayerNorm
LB, NB = 4 * L, 4 * N  # fp32 bytes


def test_bucket_sizes_follow_the_contract(results):
    """Backward runs layers 9..0 then the norm. A bucket is issued when it holds >= 4 MiB:
    3 layers are 3,151,872 bytes (< 4,194,304), 4 are 4,202,496: buckets of layers 9-6,
    5-2, and (end of backward) layers 1, 0 and the norm."""
    assert REPLICATE_BUCKET_BYTES == 4 * 2**20
    assert 3 * LB < REPLICATE_BUCKET_BYTES <= 4 * LB
    step = [("all_reduce", (0, 1), 4 * L), ("all_reduce", (0, 1), 4 * L), ("all_reduce", (0, 1), 2 * L + N)]
    failed = step[:2]  # the injected failure at layer 1 comes after two buckets were issued
    for rank in range(WORLD):
        calls = results[rank]["stack"]["calls"]
        assert calls == [step, step, failed, step, step]


def test_bucket_memory_follows_the_contract(results):
    """Gradient buffers (G) live from their first use until their bucket finished; the
    staging copy while in flight; at most MAX_INFLIGHT_REPLICATE_BUCKETS (1) in flight,
    and bucket 1 finishes BEFORE bucket 2's staging copy is made: the peak is G of
    layers 9..2 plus bucket 1's staging = 12 layers' bytes, just before bucket 2 is
    issued (staging first, then waiting for bucket 1, reached 16 L; 2 in flight would
    reach 20 L + 2 N)."""
    assert MAX_INFLIGHT_REPLICATE_BUCKETS == 1
    for rank in range(WORLD):
        r = results[rank]["stack"]
        assert r["peak_grad_bytes"] == [12 * LB] * 5
        assert r["grad_bytes_before"] == [0] * 5  # the failed step's buffers were dropped
        # after the failure bucket 2 (layers 5..2) was in flight: its G and staging
        assert r["grad_bytes_after"] == [0, 0, 8 * LB, 0, 0]


def test_bucket_becomes_grad_without_a_copy(results):
    """Each unit's .grad is a view of its bucket's (averaged) staging copy: layers of one
    bucket share a storage, buckets do not."""
    for rank in range(WORLD):
        r = results[rank]["stack"]
        names = r["unit_names"]
        ptr = dict(zip(names, r["grad_storages"][-1]))
        buckets = [[f"layers.{i}" for i in (9, 8, 7, 6)], [f"layers.{i}" for i in (5, 4, 3, 2)],
                   ["layers.1", "layers.0", "norm"]]
        storages = [{ptr[u] for u in b} for b in buckets]
        assert all(len(s) == 1 for s in storages) and len(set.union(*storages)) == 3


def test_bucketed_training_with_a_failed_backward_matches_single_process(results):
    ref_losses, ref_state = results[0]["stack_ref"]
    for rank in range(WORLD):
        r = results[rank]["stack"]
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        _assert_states_close(r["state"], ref_state, f"rank {rank}")
    assert all(torch.equal(a, b) for a, b in zip(results[0]["stack"]["shards"], results[1]["stack"]["shards"]))


# ---- clipping, param groups, failures -----------------------------------------------------------
@pytest.mark.parametrize("name", ["mix", "all_rep"])
def test_clipping_counts_rep_gradients_once(results, name):
    """2-, 1- and inf-norms every step equal single-process ones (a rep gradient summed
    over the 2 ranks would be counted twice); training with clipping, param groups by
    name, two failed steps and an evaluation under inference_mode before every step
    matches too."""
    ref_losses, ref_norms, ref_state, ref_evals = results[0]["loop_ref"]
    for rank in range(WORLD):
        run = results[rank]["loop"][name]
        torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=0)
        assert run["ndim_rule_agrees"]
        assert run["gathered_after"] == [] and run["grad_bytes_after"] == 0
    assert all(n[0] > tc.MAX_NORM for n in ref_norms), "the test must clip every step"
    run = results[0]["loop"][name]
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(run["evals"]), torch.tensor(ref_evals), rtol=1e-5, atol=0)
    _assert_states_close(run["state"], ref_state, name)


def test_torch_clip_gives_the_global_norm_with_rep_gradients_counted_once(results):
    """Sharded gradients beside rep ones (whole on every rank): torch's clip_grad_norm_
    gives the single process's norm, the rep ones counted once (it was refused); all-rep:
    every gradient whole, torch's own norm is the global one."""
    for rank in range(WORLD):
        for run in (results[rank]["loop"]["mix"], results[rank]["loop"]["all_rep"]):
            assert isinstance(run["torch_clip"], float), run["torch_clip"]
            torch.testing.assert_close(run["torch_clip"], run["osdp_clip_same_step"], rtol=1e-6, atol=0)
            torch.testing.assert_close(run["torch_clip"], results[0]["loop_ref"][1][1][0], rtol=1e-5, atol=0)


# ---- gradient accumulation ----------------------------------------------------------------------
@pytest.mark.parametrize("path", ["direct", "hooked"])
@pytest.mark.parametrize("sync", ["last", "every"])
def test_accumulation_matches_one_big_batch(results, sync, path):
    ref_losses, ref_state = results[0]["acc_ref"]
    losses, state, probe = results[0]["acc"][sync, path]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    _assert_states_close(state, ref_state, f"{sync} {path}")
    rep = sorted(u for u, m in rc.MIX.items() if m == "rep")
    if sync == "last":
        # no all-reduce before the last micro-batch: the local fp32 sums wait, in .grad
        # for a direct unit ([Note: direct replicated units]), in an fp32 accumulator
        # beside an untouched .grad on the hook path
        if path == "direct":
            assert probe["rep_accumulators"] == {u: ".grad torch.float32" for u in rep}
        else:
            assert probe["rep_accumulators"] == {u: "buffer torch.float32" for u in rep}
            assert probe["rep_has_grad_after_first_micro"] is False
        assert probe["all_reduces"] == {u: 1 for u in rep}
    else:
        assert probe["rep_accumulators"] == {u: None for u in rep}
        assert probe["rep_has_grad_after_first_micro"] is True
        assert probe["all_reduces"] == {u: fc.MICRO for u in rep}
    assert probe["grad_bytes_after_step"] == 0


# ---- mixed precision ---------------------------------------------------------------------------
def test_mixed_precision_matches_fsdp2_and_autocast(results):
    rank0 = results[0]
    losses, state, probe = rank0["mp"]
    fsdp_losses, _, fsdp_grads = rank0["mp_fsdp2"]
    ref_losses, ref_grads, _ = rank0["mp_ref"]
    grads = probe["first_grads"]
    assert set(grads) == set(ref_grads)
    for key in fsdp_grads:  # the same bf16 math as FSDP2, fp32 reduction
        torch.testing.assert_close(grads[key], fsdp_grads[key], rtol=1e-6, atol=1e-6, msg=key)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(fsdp_losses), rtol=1e-3, atol=0)
    fsdp_err = fc.rel_err(fsdp_grads, ref_grads)
    assert 0 < fsdp_err < 2e-2
    assert fc.rel_err(grads, ref_grads) <= 2 * fsdp_err
    assert fc.max_rel(losses, ref_losses) <= 2 * fc.max_rel(fsdp_losses, ref_losses) + 1e-3
    initial = pc.make_model("uneven").state_dict()
    assert max((state[k] - initial[k]).abs().max().item() for k in initial) > 1e-2


def test_mixed_precision_rep_copy_is_cast_locally_after_each_step(results):
    modes = rc.mp_modes()
    rep = sorted(u for u, m in modes.items() if m == "rep")
    for rank in range(WORLD):
        probe = results[rank]["mp"][2]
        assert sorted(probe["rep_units"]) == rep and len(rep) >= 3
        assert not set(rep) & set(probe["gathered_bytes"])  # never gathered
        for unit in set(modes) - set(rep):
            assert probe["gathered_bytes"][unit] == 2 * probe["padded"][unit], unit  # bf16 gathers
        assert probe["copy_dtypes"] == ["torch.bfloat16"]
        assert probe["replica_copy_bytes"] == 2 * sum(probe["numels"][u] for u in rep)
        assert probe["grad_dtypes"] == ["torch.float32"]
        # after every forward the copy is the master in bf16; after the step, stale
        assert probe["copies"] == [(True, False)] * fc.MP_STEPS


# ---- checkpoints ----------------------------------------------------------------------------------
def test_sharded_checkpoint_into_rep_plan_and_back_is_exact(results):
    for rank in range(WORLD):
        c = results[rank]["ckpt"]
        assert c["step_r"] == 3
        assert "rep" in c["rep_modes"].values() and "zdp" in c["rep_modes"].values()
        _assert_states_equal(c["full_r"], c["full_a"], "zdp+split checkpoint loaded into the rep plan")
        ref_a, steps_a = c["optim_a"]
        ref_r, steps_r = c["optim_r"]
        assert steps_r == steps_a == {3.0}
        _assert_states_equal(ref_r, ref_a, "optimizer state in the rep plan", ordered=False)
        assert all(v.abs().max() > 0 for v in ref_a.values())
        # and back: zdp+split -> rep -> zdp+split, every unit's shard and AdamW state exact
        for i, ((shard_a, st_a), (shard_b, st_b)) in enumerate(zip(c["unit_state_a"], c["unit_state_a2"])):
            assert torch.equal(shard_a, shard_b), f"unit {i}"
            for j, (x, y) in enumerate(zip(st_a, st_b)):
                assert sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x), f"unit {i} param {j}"
    c = results[0]["ckpt"]
    torch.testing.assert_close(torch.tensor(c["losses_r"]), torch.tensor(c["losses_a"]), rtol=1e-5, atol=0)
    _assert_states_close(c["continued_r"], c["continued_a"], "rep plan went on like the zdp plan")


def test_rep_checkpoint_into_same_and_other_plans(results):
    for rank in range(WORLD):
        c = results[rank]["ckpt"]
        _assert_states_equal(c["full_b"], c["saved_r"], "rep checkpoint loaded into plan B")
        _assert_states_equal(c["optim_b"][0], c["saved_optim_r"][0], "optimizer state in plan B", ordered=False)
        for (shard_a, st_a), (shard_b, st_b) in zip(c["unit_state_r"], c["unit_state_r2"]):
            assert torch.equal(shard_a, shard_b)
            for x, y in zip(st_a, st_b):
                assert sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)
        # resuming the same plan is bit-identical; another plan within the tolerance
        assert c["losses_more"]["r"] == c["losses_more"]["r2"]
        _assert_states_equal(c["more"]["r2"], c["more"]["r"], "resumed rep plan")
        _assert_states_close(c["more"]["b"], c["more"]["r"], "plan B from the rep checkpoint")


def test_full_state_dicts_with_rep_units(results):
    for rank in range(WORLD):
        c = results[rank]["ckpt"]
        _assert_states_equal(c["full_into_rep"], c["full_saved"], "save_full -> all-rep load_full")
        _assert_states_equal(c["full_into_a"], c["full_saved"], "save_full -> zdp+split load_full")
        _assert_states_equal(c["plain_into_rep"], c["plain_state"], "plain state dict -> rep plan")
        full = c["full_r"]
        for name, shape in c["rep_param_shapes"].items():
            if c["rep_modes"].get(name.rsplit(".", 1)[0]) == "rep":
                assert shape == tuple(full[name].shape), name
                assert c["rep_local_state_shapes"][name] == shape, name


def test_rep_tensors_are_written_once_whole_by_rank_0(results):
    """Like replicated entries (DCP would also de-duplicate chunks every rank offered,
    but hand them to whichever rank writes least: the file name says which rank wrote)."""
    c = results[0]["ckpt"]
    meta_r = FileSystemReader(c["paths"]["r"]).read_metadata()
    md_r = meta_r.state_dict_metadata
    md_a = FileSystemReader(c["paths"]["a"]).read_metadata().state_dict_metadata
    modes = c["rep_modes"]
    rep_params = [k for k in c["full_r"] if modes.get(k.rsplit(".", 1)[0]) == "rep"]
    assert "wte.weight" in rep_params and len(rep_params) > 10
    for name in rep_params:
        for key in (f"model.{name}", f"optim.{name}.exp_avg", f"optim.{name}.exp_avg_sq"):
            chunks = md_r[key].chunks
            assert len(chunks) == 1, key  # one rank wrote it, whole
            assert tuple(chunks[0].offsets) == (0,) * len(md_r[key].size)
            assert tuple(chunks[0].sizes) == tuple(md_r[key].size)
            files = {info.relative_path for index, info in meta_r.storage_data.items() if index.fqn == key}
            assert len(files) == 1 and files.pop().startswith("__0_"), key  # FileSystemWriter: __<rank>_<n>
    # the same parameters sharded in plan A: pieces from both ranks
    assert len(md_a["model.wte.weight"].chunks) >= 2
    sharded = "model.blocks.1.attn.c_attn.weight"  # dp in the rep plan
    assert modes["blocks.1.attn.c_attn"] == "dp" and len(md_r[sharded].chunks) >= 2

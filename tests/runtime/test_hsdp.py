"""Hierarchical sharding on 4 gloo ranks as 2 "nodes" x 2 (see ``hsdp_cases.py``):
parity with one process for every mode mix on an HSDP mesh and on a full shard with
hpz nodes, collective counts per level, node-copy memory, and checkpoints written once
per shard group that load into 1-D, 2-D and 1-rank layouts.

Expectations come from the mode table ([Note: modes per level] in osdp/contract.py),
written out here: per step and unit, ``dp`` gathers once over the shard group, ``zdp``
twice, ``hpz`` once over the shard group and once over its node; every unit's gradient
is reduced once over the shard group and, with replicas, all-reduced once over its
replicate group. Tolerances as in test_parity.py: losses rtol 1e-5, parameters
rtol/atol 1e-5 against single-process training on the global batch.
"""
from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from . import hsdp_cases as hc
from .dist_harness import spawn

# the matrix runs in one spawn of 4 ranks (about 30 s on 2 shared cores): slow; one
# representative (full shard, hpz in 2-rank nodes, every mode) runs in the default suite

PARITY_RUNS = [
    (layout, case, None)
    for layout in ("hsdp", "full_node2")
    for case in ("mix", "all_hpz", "hpz_checkpoint")
] + [("hsdp_node1", "mix", None)]
COUNT_RUNS = [(layout, "mix", 0) for layout in ("hsdp", "full_node2", "hsdp_node1")]
_RESULTS: dict = {}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if "out" not in _RESULTS:
        root = str(tmp_path_factory.mktemp("hsdp_ckpt"))
        _RESULTS["out"] = spawn(hc.run_all, 4, root, PARITY_RUNS + COUNT_RUNS)
        _RESULTS["root"] = root
    return _RESULTS["out"]


# ---- the layouts, written out ------------------------------------------------------------
def shard_ranks(layout, rank):
    return (0, 1, 2, 3) if layout == "full_node2" else ((0, 1) if rank < 2 else (2, 3))


def node_ranks(layout, rank):
    """hpz's backward group: 2-rank nodes; in HSDP the shard group is the node."""
    if layout == "hsdp_node1":
        return (rank,)
    return (0, 1) if rank < 2 else (2, 3)


def replicate_ranks(layout, rank):
    return None if layout == "full_node2" else (rank % 2, rank % 2 + 2)


def effective(layout, mode):
    """[Note: modes per level]: hpz is zdp when the node is the shard group, dp with
    one rank per node."""
    if mode != "hpz":
        return mode
    return {"full_node2": "hpz", "hsdp": "zdp", "hsdp_node1": "dp"}[layout]


def needs_weights_in_backward(unit):
    return not unit.startswith("wte[")  # an Embedding cut by rows reads no weights in backward


# ---- parity ------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("run", PARITY_RUNS + COUNT_RUNS, ids=lambda r: f"{r[0]}-{r[1]}-c{r[2]}")
def test_parity_with_single_process(results, run):
    ref_losses, ref_state = results[0]["ref"]
    for rank in range(4):
        losses, state, probe = results[rank]["train"][run]
        assert len(losses) == hc.STEPS
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        assert list(state) == list(ref_state)
        for key in ref_state:
            torch.testing.assert_close(state[key], ref_state[key], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {key}: {m}")
    initial = hc.make_model(hc.MODEL).state_dict()
    assert max((state[k] - initial[k]).abs().max().item() for k in ref_state) > 1e-2  # it trained
    modes = set(results[0]["train"][run][2]["unit_modes"].values())
    assert "hpz" in modes
    # torch's gradient norm helper gives the model's global norm on every layout, the same on every rank
    norms = [results[rank]["train"][run][2]["norms"] for rank in range(4)]
    for torch_norm, osdp_norm in norms:
        assert torch_norm == pytest.approx(osdp_norm, rel=1e-6)
    assert len({round(n[1], 6) for n in norms}) == 1


@pytest.mark.slow
def test_every_mode_mix_is_covered(results):
    probe = results[0]["train"][("full_node2", "mix", None)][2]
    modes = probe["unit_modes"]
    assert {modes[f"blocks.0.mlp.c_fc[{i}]"] for i in range(4)} == {"hpz", "dp", "zdp"}
    assert [modes[f"wte[{i}]"] for i in range(3)] == ["zdp", "hpz", "dp"]
    assert {"dp", "zdp", "hpz"} <= {m for n, m in modes.items() if "[" not in n}


# ---- collectives per level -----------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["hsdp", "full_node2", "hsdp_node1"])
def test_collective_counts_per_level(results, layout):
    for rank in range(4):
        _, _, probe = results[rank]["train"][(layout, "mix", 0)]
        expected: dict[tuple, int] = {}

        def add(op, ranks, n=1):
            expected[(op, ranks)] = expected.get((op, ranks), 0) + n

        shard, node, replicas = shard_ranks(layout, rank), node_ranks(layout, rank), replicate_ranks(layout, rank)
        for unit, mode in probe["unit_modes"].items():
            mode = effective(layout, mode)
            add("all_gather", shard)  # forward
            if needs_weights_in_backward(unit):
                if mode == "zdp":
                    add("all_gather", shard)
                elif mode == "hpz":
                    add("all_gather", node)  # from the node copy, over the fast link only
            add("all_reduce", shard)  # the gradient, on gloo an all-reduce (contract.gradient_collective)
            if replicas is not None:
                add("all_reduce", replicas)  # then across replicas
        assert probe["counts"] == expected, f"rank {rank}"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["hsdp", "full_node2", "hsdp_node1"])
def test_node_copies_and_kept_weights_after_forward(results, layout):
    for rank in range(4):
        _, _, probe = results[rank]["train"][(layout, "mix", 0)]
        modes = {u: effective(layout, m) for u, m in probe["unit_modes"].items()}
        hpz = sorted(u for u, m in modes.items() if m == "hpz" and needs_weights_in_backward(u))
        node = len(node_ranks(layout, rank))
        assert probe["node_copy_units_after_forward"] == hpz
        assert probe["node_copy_bytes_after_forward"] == sum(probe["gathered_bytes"][u] // node for u in hpz)
        kept = sorted(u for u, m in modes.items() if m == "dp" and needs_weights_in_backward(u))
        assert sorted(probe["gathered_after_forward"]) == kept
        assert probe["node_copy_bytes_after_backward"] == 0 and probe["gathered_after_backward"] == []
    if layout == "full_node2":
        assert hpz  # the case does exercise node copies


# ---- checkpoints ---------------------------------------------------------------------------
def _stored_chunks(path):
    """key -> [(offsets, sizes, file)] as DCP's metadata lists them."""
    meta = FileSystemReader(path).read_metadata()
    out = {}
    for key, md in meta.state_dict_metadata.items():
        for chunk in md.chunks:
            index = [i for i in meta.storage_data if i.fqn == key and tuple(i.offset) == tuple(chunk.offsets)]
            files = [meta.storage_data[i].relative_path for i in index]
            out.setdefault(key, []).append((tuple(chunk.offsets), tuple(chunk.sizes), tuple(files), tuple(md.size)))
    return out


def _coverage(chunks):
    size = chunks[0][3]
    count = torch.zeros(size, dtype=torch.int32)
    for offsets, sizes, _, _ in chunks:
        box = count
        for dim, (o, s) in enumerate(zip(offsets, sizes)):
            box = box.narrow(dim, o, s)
        box += 1
    return count


@pytest.mark.slow
def test_checkpoint_2d_written_once_per_shard_group(results):
    path = os.path.join(_RESULTS["root"], "ckpt_2d")
    chunks = _stored_chunks(path)
    ref_state = results[0]["ref"][1]
    assert {k[len("model."):] for k in chunks if k.startswith("model.")} == set(ref_state)
    assert any(k.startswith("optim.") and k.endswith(".exp_avg") for k in chunks)
    writers = set()
    for key, entries in chunks.items():
        assert bool((_coverage(entries) == 1).all()), f"{key}: every element stored exactly once"
        for _, _, files, _ in entries:
            assert len(files) == 1, f"{key}: one stored copy per chunk"
            writers.add(files[0])
    # only replica 0 (global ranks 0 and 1) wrote data files
    assert writers and all(f.startswith(("__0_", "__1_")) for f in writers), sorted(writers)
    data_files = [f for f in os.listdir(path) if f.endswith(".distcp")]
    assert all(os.path.getsize(os.path.join(path, f)) == 0 for f in data_files if f.startswith(("__2_", "__3_")))
    # the 1-D checkpoint: every rank holds a quarter, all four wrote
    chunks_1d = _stored_chunks(os.path.join(_RESULTS["root"], "ckpt_1d"))
    writers_1d = {files[0][:3] for entries in chunks_1d.values() for _, _, files, _ in entries}
    assert writers_1d == {"__0", "__1", "__2", "__3"}
    for key, entries in chunks_1d.items():
        assert bool((_coverage(entries) == 1).all()), key


def _same(a, b, exact=True):
    assert list(a) == list(b)
    for key in a:
        if exact:
            assert torch.equal(a[key], b[key]), key
        else:
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")


@pytest.mark.slow
def test_checkpoint_2d_loads_into_1d_and_back(results):
    for rank in range(4):
        out = results[rank]["checkpoint"]
        assert out["step"] == 3
        _same(out["loaded_1d"], out["saved_2d"])  # the state, exactly
        # the optimizer state came through: both layouts train on identically
        _same(out["continued_1d"], out["continued_2d"], exact=False)
        _same(out["loaded_2d_from_1d"], out["continued_1d"])
        _same(out["continued_2d_from_1d"], out["continued_1d_again"], exact=False)
        moved = max((out["continued_2d"][k] - out["saved_2d"][k]).abs().max().item() for k in out["saved_2d"])
        assert moved > 1e-3


@pytest.mark.slow
def test_checkpoint_2d_loads_into_one_rank(results):
    out = results[0]["checkpoint"]
    _same(out["loaded_1rank"], out["saved_2d"])
    _same(out["continued_1rank"], out["continued_2d"], exact=False)


def test_fast_full_shard_hpz_nodes_parity_and_counts():
    """The representative of the matrix above in the default run: full shard over 4
    with hpz re-gathering in 2-rank nodes, every mode and split slices in each mode."""
    run = ("full_node2", "mix", 0)
    out = spawn(hc.run_all, 4, "", [run])
    ref_losses, ref_state = out[0]["ref"]
    for rank in range(4):
        losses, state, probe = out[rank]["train"][run]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for key in ref_state:
            torch.testing.assert_close(state[key], ref_state[key], rtol=1e-5, atol=1e-5)
        node = node_ranks("full_node2", rank)
        hpz = [u for u, m in probe["unit_modes"].items() if m == "hpz" and needs_weights_in_backward(u)]
        assert hpz and probe["counts"][("all_gather", node)] == len(hpz)
        zdp = [u for u, m in probe["unit_modes"].items() if m == "zdp" and needs_weights_in_backward(u)]
        assert probe["counts"][("all_gather", (0, 1, 2, 3))] == len(probe["unit_modes"]) + len(zdp)


# ---- the rule and the arguments (one process) ------------------------------------------
def test_effective_mode_rule():
    from osdp.contract import effective_mode

    assert effective_mode("hpz", 2, 4) == "hpz"  # two nodes of 2: the node copy
    assert effective_mode("hpz", 4, 4) == "zdp"  # the shard group is one node
    assert effective_mode("hpz", 1, 4) == "dp"  # a copy sharded over one rank is the whole unit
    assert effective_mode("zdp", 2, 4) == "zdp" and effective_mode("dp", 2, 4) == "dp"


@pytest.mark.usefixtures("one_rank_group")
def test_layout_arguments_are_checked():
    import osdp
    from osdp.errors import OSDPError
    from torch.distributed.device_mesh import init_device_mesh

    model = hc.make_model(hc.MODEL)
    with pytest.raises(OSDPError, match=r"node_size=3 does not divide the shard group of 1 ranks"):
        osdp.OSDP(model, node_size=3)
    with pytest.raises(OSDPError, match=r"node_size must be an integer >= 1"):
        osdp.OSDP(model, node_size=0)
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("shard", "replicate"))
    with pytest.raises(OSDPError, match=r"\('replicate', 'shard'\)"):
        osdp.OSDP(model, mesh=mesh)
    with pytest.raises(OSDPError, match="not both"):
        osdp.OSDP(model, mesh=mesh, process_group=torch.distributed.group.WORLD)
    wrapped = osdp.OSDP(model, mesh=init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard")),
                        default_mode="hpz")
    assert wrapped.layout.shard.size == 1 and wrapped.layout.replicate.size == 1
    assert wrapped.unit_modes()["lm_head"] == "hpz"

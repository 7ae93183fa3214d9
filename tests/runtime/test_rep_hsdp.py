"""``rep`` units on 4 gloo ranks as 2 "nodes" x 2 (hsdp_cases' layouts): an HSDP mesh
(2 replicas x shard groups of 2) and a full shard with hpz in 2-rank nodes, each with
hsdp_cases' mode mix (dp, zdp, hpz, split slices) and four rep units. A rep unit is
whole on all 4 ranks and its gradients are all-reduced over all 4 in one collective
(contract.py [Note: replicated units]); sharded units keep their per-level collectives.
Checkpoints: 2-D with rep units -> 1-D all-zdp -> 2-D, exactly. Tolerances as
test_hsdp.py (losses rtol 1e-5, parameters rtol/atol 1e-5 against one process)."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from . import rep_cases as rc
from .dist_harness import spawn

pytestmark = pytest.mark.slow  # one spawn of 4 ranks on 2 shared cores

WORLD = 4
REP = ("wpe", "blocks.0.ln_1", "blocks.1.mlp.c_fc", "lm_head")
_RESULTS: dict = {}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if "out" not in _RESULTS:
        _RESULTS["out"] = spawn(rc.run_hsdp, WORLD, str(tmp_path_factory.mktemp("rep_hsdp")))
    return _RESULTS["out"]


def _equal(a, b, what):
    assert sorted(a) == sorted(b), what
    for key in a:
        assert torch.equal(a[key], b[key]), f"{what}: {key}"


@pytest.mark.parametrize("layout", ["hsdp", "full_node2"])
def test_parity_and_identical_replicas(results, layout):
    ref_losses, ref_state = results[0]["ref"]
    for rank in range(WORLD):
        losses, state, probe = results[rank]["train"][layout]
        assert {u for u, m in probe["unit_modes"].items() if m == "rep"} == set(REP)
        assert "hpz" in probe["unit_modes"].values()
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for key in ref_state:
            torch.testing.assert_close(state[key], ref_state[key], rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")
        for unit, shard in probe["rep_shards_end"].items():  # every replica, every shard rank: one copy
            assert torch.equal(shard, results[0]["train"][layout][2]["rep_shards_end"][unit]), (rank, unit)


@pytest.mark.parametrize("layout", ["hsdp", "full_node2"])
def test_rep_gradients_all_reduced_once_over_every_rank(results, layout):
    for rank in range(WORLD):
        probe = results[rank]["train"][layout][2]
        numels, padded = probe["numels"], probe["padded"]
        rep_total = sum(numels[u] for u in REP)
        world_reduces = [n for op, ranks, n in probe["calls"] if op == "all_reduce" and ranks == (0, 1, 2, 3)]
        assert world_reduces.count(rep_total) == 1
        if layout == "hsdp":  # sharded units reduce within the shard group and the replicate pair
            assert world_reduces == [rep_total]
        assert not set(REP) & set(probe["all_gathers"]) and not set(REP) & set(probe["reduce_scatters"])
        assert probe["all_reduces"] == {u: 1 for u in REP}
        sharded = [u for u in probe["unit_modes"] if u not in REP]
        gathered = sum(n for op, _, n in probe["calls"] if op == "all_gather")
        assert gathered == sum(padded[u] * probe["all_gathers"].get(u, 0) for u in sharded)


def test_checkpoints_between_hsdp_with_rep_and_1d(results):
    for rank in range(WORLD):
        c = results[rank]["ckpt"]
        _equal(c["loaded_1d"], c["saved_2d"], "2-D rep -> 1-D zdp")
        _equal(c["optim_1d"][0], c["optim_2d"][0], "optimizer state 2-D rep -> 1-D zdp")
        _equal(c["loaded_2d"], c["saved_1d"], "1-D zdp -> 2-D rep")
        _equal(c["optim_2d_loaded"][0], c["optim_1d_end"][0], "optimizer state 1-D zdp -> 2-D rep")
        for key in c["continued_2d"]:
            torch.testing.assert_close(c["continued_1d"][key], c["continued_2d"][key], rtol=1e-5, atol=1e-5)
    meta = FileSystemReader(results[0]["ckpt"]["path_2d"]).read_metadata()
    for unit in REP:
        for suffix in ("weight", "bias"):
            key = f"model.{unit}.{suffix}"
            if key not in meta.state_dict_metadata:
                continue
            assert len(meta.state_dict_metadata[key].chunks) == 1, key
            files = {i.relative_path for idx, i in meta.storage_data.items() if idx.fqn == key}
            assert len(files) == 1 and files.pop().startswith("__0_"), key

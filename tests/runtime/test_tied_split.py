"""The tied row split on 2 and 3 gloo ranks: a tiny GPT (vocabulary 211, hidden 16)
whose embedding table is split by rows into slices with mixed modes, tied to the LM
head (one weight, one set of slices, see [Note: tied row split] in osdp/contract.py)
or untied (the head split along vocabulary on its own). Against single-process
training (losses and final parameters at rtol 1e-5, AdamW), and checkpoints of the
split tied weight loaded into unsplit models (same ranks, 1 rank, the plain model).

One spawn per world size runs every case (``tied_split_cases.py``).
"""
from __future__ import annotations

import pytest
import torch

from . import tied_split_cases as tc
from .dist_harness import spawn

pytestmark = pytest.mark.slow  # one spawn per world size, about 25 s each on this machine

_RESULTS: dict = {}
WORLDS = (2, 3)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tied"))


def results(world, root):
    if world not in _RESULTS:
        _RESULTS[world] = spawn(tc.run_all, world, root)
    return _RESULTS[world]


PARAMS = [(w, name) for w in WORLDS for name in tc.CASES]


@pytest.mark.parametrize("world,name", PARAMS, ids=[f"w{w}-{n}" for w, n in PARAMS])
def test_training_matches_single_process(world, name, root):
    rank0 = results(world, root)[0]
    losses, state, _ = rank0["osdp"][name]
    key = tc.CASES[name][0]
    ref_losses, ref_state = rank0["ref"][key]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert list(state) == list(ref_state), "full_state_dict: the original keys, in order"
    for k in ref_state:
        torch.testing.assert_close(state[k], ref_state[k], rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")
    if key == "tied":
        assert state["lm_head.weight"] is state["wte.weight"], "tied names share one tensor"
    initial = tc.make(key).state_dict()
    assert max((state[k] - initial[k]).abs().max().item() for k in ref_state) > 1e-2, "it trained"


def _expected_gathers(name, unit, mode):
    """All-gathers per step of one unit: a tied slice has two uses (lookup, head), the
    lookup's backward reads no weights: dp 2 (lookup and head forward), zdp 3 (and the
    head's backward); an untied embedding slice 1 in either mode."""
    if unit.startswith("wte["):
        if name.startswith("tied"):
            return 2 if mode == "dp" else 3
        return 1
    return 1 if mode == "dp" else 2


@pytest.mark.parametrize("world,name", PARAMS, ids=[f"w{w}-{n}" for w, n in PARAMS])
def test_ledger_one_reduce_per_slice_and_modes(world, name, root):
    for rank, result in enumerate(results(world, root)):
        _, _, probe = result["osdp"][name]
        modes = probe["unit_modes"]
        for unit, mode in modes.items():
            assert probe["all_gathers"].get(unit, 0) == _expected_gathers(name, unit, mode), (rank, unit, mode)
            # the gradients of both uses of a tied slice are summed: ONE reduce-scatter
            assert probe["reduce_scatters"].get(unit, 0) == 1, (rank, unit)
        # after forward: dp units waiting for a backward that reads weights (an untied
        # embedding's slices are freed in either mode; a tied dp slice waits for the head)
        kept = {u for u, m in modes.items() if m == "dp" and not (u.startswith("wte[") and name == "untied")}
        assert set(probe["gathered_after_forward"]) == kept, rank
        assert probe["gathered_after_backward"] == [] and probe["grad_bytes_after_backward"] == 0


def test_plan_naming(root):
    probes = {name: results(2, root)[0]["osdp"][name][2] for name in tc.CASES}
    g4, g3, untied = probes["tied_g4"], probes["tied_g3_by_head"], probes["untied"]
    # one unit per slice, named after the owner; the head is its tied use
    assert [u for u in g4["unit_modes"] if u.startswith(("wte", "lm_head"))] == [f"wte[{i}]" for i in range(4)]
    assert [g4["unit_modes"][f"wte[{i}]"] for i in range(4)] == ["dp", "zdp", "zdp", "dp"]
    assert g4["tied"] == {"lm_head": "wte"}
    # splits / modes given under the head's name land on the owner
    assert [g3["unit_modes"][f"wte[{i}]"] for i in range(3)] == ["zdp", "dp", "zdp"]
    assert not any(u.startswith("lm_head") for u in g3["unit_modes"])
    # parameters: one per original parameter, by the owner's name ([Note: split parameters]:
    # the slices' shards are one Parameter; issue 35.1); local state: both names, whole
    assert [n for n in g4["param_names"] if n.startswith(("wte.", "lm_head."))] == ["wte.weight"]
    keys = g4["local_keys"]
    assert [k for k in keys if k.startswith(("wte.", "lm_head."))] == ["wte.weight", "lm_head.weight"]
    assert [k for k in untied["param_names"] if k.startswith("lm_head.")] == ["lm_head.weight"]
    assert untied["tied"] == {}


@pytest.mark.parametrize("world", WORLDS)
def test_checkpoint_of_split_tied_weight_loads_unsplit_and_back(world, root):
    res = results(world, root)
    c = res[0]["ckpt"]
    saved = c["saved"]
    assert c["info"]["step"] == 3
    # split (4 slices) -> unsplit on the same ranks, on 1 rank, the plain model; and the
    # unsplit model's next checkpoint -> split again (3 slices, other modes)
    for what, expected in (("unsplit_loaded", saved), ("one_rank_loaded", saved), ("plain_loaded", saved),
                           ("resplit_loaded", c["unsplit_next"])):
        assert list(c[what]) == list(expected), what
        for k in expected:
            assert torch.equal(c[what][k], expected[k]), f"{what}: {k}"
    assert c["plain_tied"]
    # the optimizer state came along: the next step agrees (split vs unsplit summation order)
    for k in saved:
        torch.testing.assert_close(c["unsplit_next"][k], c["saved_next"][k], rtol=1e-5, atol=1e-5)
    assert any(not torch.equal(c["saved_next"][k], saved[k]) for k in saved)
    for other in res[1:]:
        assert other["ckpt"]["saved"] == {} and "one_rank_loaded" not in other["ckpt"]

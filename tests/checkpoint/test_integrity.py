"""Sharded checkpoints detect damaged data, and failed loads lead with their cause.

Two gloo ranks (``integrity_cases.run_w2``, one spawn) save a checkpoint, flip one bit
inside a tensor's data in a saved ``.distcp`` file (a parameter chunk and an AdamW
``exp_avg_sq`` chunk, both written by rank 1), and load it at the same plan, with
another plan and on one rank (resharded: partial reads of the damaged chunk). Plain
DCP reading the same files is the reference for what the flip did. In-process tests
(a 1-rank group) cover checkpoints without checksums and the reader's fallback.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from osdp.errors import OSDPError
from runtime.dist_harness import spawn

from . import ckpt_cases as cc
from . import integrity_cases as ic

_RESULTS: list = []


@pytest.fixture(scope="module")
def w2(tmp_path_factory):
    if not _RESULTS:
        _RESULTS.extend(spawn(ic.run_w2, 2, str(tmp_path_factory.mktemp("integrity"))))
    return _RESULTS


def first_line(err: dict) -> str:
    return err["message"].splitlines()[0]


def assert_equal_states(a, b, what):
    assert list(a) == list(b), f"{what}: keys differ"
    for key in a:
        assert torch.equal(a[key], b[key]), f"{what}: {key}"


# ---- damaged data -----------------------------------------------------------------------
@pytest.mark.parametrize("how", ["", "_plan_b", "_one_rank"], ids=["same_plan", "other_plan", "one_rank"])
@pytest.mark.parametrize("name", ["param", "adam"])
def test_flipped_bit_is_an_error_naming_key_chunk_and_file(w2, name, how):
    r0 = w2[0]
    # the reference: plain DCP reads the damaged checkpoint without complaint, and exactly
    # one element differs from the good one (the flip is inside the tensor's data)
    good, bad = r0[f"{name}_plain"]
    assert int((good != bad).sum()) == 1, "the flipped bit must change exactly one element"
    if name == "param":
        assert torch.equal(good, r0["saved_full"][ic.PARAM_FQN])
    offsets = r0[f"{name}_offsets"]
    ranks = [r0] if how == "_one_rank" else w2
    for r in ranks:
        err = r[f"err_{name}{how}"]
        assert err is not None, "a damaged checkpoint loaded without error"
        assert err["type"] == "CheckpointCorruptedError" and err["osdp"], err
        line = first_line(err)
        if name == "param":
            assert f"parameter {ic.PARAM_FQN!r}" in line, line
        else:
            assert f"optimizer state 'exp_avg_sq' of parameter {ic.ADAM_FQN!r}" in line, line
        assert f"offsets {list(offsets)}" in line, line
        assert ic.DAMAGED_FILE in line, line


def test_clean_resharded_loads_raise_no_false_alarm(w2):
    r0 = w2[0]
    for key in ("clean_plan_b", "clean_one_rank"):
        step, full = r0[key]
        assert step == 2
        assert_equal_states(full, r0["saved_full"], key)


def test_failed_loads_change_nothing(w2):
    for r in w2:
        before, after = r["unchanged"]
        assert any(any(states) for _, states in before), "the optimizer had state to lose"
        assert len(before) == len(after)
        for (shard_a, states_a), (shard_b, states_b) in zip(before, after):
            assert torch.equal(shard_a, shard_b)
            assert len(states_a) == len(states_b)
            for state_a, state_b in zip(states_a, states_b):  # one per original parameter
                assert sorted(state_a) == sorted(state_b)
                for key in state_a:
                    assert torch.equal(state_a[key], state_b[key]), key


# ---- errors lead with their cause ---------------------------------------------------------
CAUSES = {
    "missing": (["FileNotFoundError", "No such file or directory", ic.DAMAGED_FILE], "FileNotFoundError"),
    "truncated": ([ic.DAMAGED_FILE, "truncated"], "CheckpointCorruptedError"),
    "no_key": (["no entries", "optim.wte.weight.exp_avg"], "OSDPError"),
    "write": (["simulated crash while writing"], "RuntimeError"),
}


@pytest.mark.parametrize("case", list(CAUSES))
def test_failed_checkpoint_error_leads_with_the_cause(w2, case):
    words, cause = CAUSES[case]
    for r in w2:
        err = r[f"err_{case}"]
        assert err is not None and err["osdp"], err
        line = first_line(err)
        for word in words:
            assert word in line, f"first line does not name the cause ({word!r}): {line}"
        assert err["cause"] == cause, err
        assert "Traceback" not in err["message"] and len(err["message"].splitlines()) <= 4, err["message"]
    assert w2[0][f"err_{case}"]["message"] == w2[1][f"err_{case}"]["message"], "every rank reports the same cause"


# ---- in-process (1 rank) ---------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path, one_rank_group):
    """A 1-rank checkpoint after two AdamW steps, and its full state (the reference)."""
    import osdp.checkpoint as ck

    model, opt = cc.wrap(cc.PLAN_A)
    cc.train(model, opt, range(2))
    path = str(tmp_path / "ckpt")
    ck.save(model, opt, path, step=2)
    return path, ck.full_state_dict(model)


def test_checkpoint_without_checksums_loads_with_a_warning(saved):
    import osdp.checkpoint as ck

    path, reference = saved
    meta_file = os.path.join(path, "osdp_meta.pt")
    meta = torch.load(meta_file, weights_only=True)
    meta.pop("checksums", None)  # what the previous format (version 1) wrote
    meta["version"] = 1
    torch.save(meta, meta_file)
    model, opt = cc.wrap(cc.PLAN_B, seed=5)
    with pytest.warns(UserWarning, match="no checksums") as record:
        assert ck.load(model, opt, path)["step"] == 2
    assert type(record[0].message).__name__ == "UnverifiedCheckpointWarning"
    assert_equal_states(ck.full_state_dict(model), reference, "checkpoint without checksums")


def test_chunks_are_verified_even_where_the_reader_hook_is_not_called(saved, monkeypatch):
    """If a future DCP stopped reading through ``_slice_file``, every chunk is still
    verified (after DCP read it into fresh buffers, before anything changes)."""
    import osdp.checkpoint as ck
    from osdp.checkpoint import _integrity

    path, _ = saved
    offsets = ic.flip(path, ic.ADAM_KEY, file="__0_0.distcp")
    monkeypatch.setattr(_integrity.VerifyingReader, "_slice_file", dcp.FileSystemReader._slice_file)
    model, opt = cc.wrap(cc.PLAN_A, seed=5)
    cc.train(model, opt, range(1))
    before = ck.full_state_dict(model)
    with pytest.raises(OSDPError, match=r"optimizer state 'exp_avg_sq'") as info:
        ck.load(model, opt, path)
    assert type(info.value).__name__ == "CheckpointCorruptedError"
    assert f"offsets {list(offsets)}" in str(info.value)
    assert_equal_states(ck.full_state_dict(model), before, "model after the failed load")


def test_a_truncated_full_checkpoint_file_names_itself(tmp_path, one_rank_group):
    """load_full of a truncated save_full file raised a bare "OSError: [Errno 22]
    Invalid argument" (found by a helper); the model is unchanged."""
    import osdp
    import osdp.checkpoint as ckpt
    from osdp.errors import CheckpointCorruptedError
    from osdp.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = osdp.OSDP(GPT(GPTConfig(vocab_size=50, seq_len=8, num_layers=1, hidden=8, heads=2)), default_mode="zdp")
    path = str(tmp_path / "model.pt")
    ckpt.save_full(model, path)
    before = model.full_state_dict()
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(CheckpointCorruptedError, match=r"model\.pt' is not a readable full checkpoint.*truncated"):
        ckpt.load_full(model, path)
    for key, value in model.full_state_dict().items():
        assert torch.equal(value, before[key]), key

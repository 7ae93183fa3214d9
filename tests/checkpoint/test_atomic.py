"""The two-rename fallback of the atomic save (no ``RENAME_EXCHANGE``) and the backup it
makes (``.<name>.osdp-old``): a crash or failure between the renames, and what the next
save and load do about the backup. In-process, a 1-rank group; the references are the
full state dicts taken when each version was saved."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

import osdp.checkpoint as ck
from osdp.checkpoint import _atomic
from osdp.errors import OSDPError

from . import ckpt_cases as cc

pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py


class _Died(BaseException):
    """The process dies here: no ``except Exception`` cleanup runs after it."""


class _OsRenameHook:
    """``os`` as ``_atomic`` sees it, with ``hook(src, dst)`` called before each rename."""

    def __init__(self, hook):
        self._hook = hook

    def __getattr__(self, name):
        return getattr(os, name)

    def rename(self, src, dst):
        self._hook(os.fspath(src), os.fspath(dst))
        os.rename(src, dst)


def _onto(path, exc):
    """A hook raising ``exc`` when the finished partial directory is renamed onto ``path``."""

    def hook(src, dst):
        if src.endswith(".osdp-partial") and os.path.abspath(dst) == path:
            raise exc

    return hook


def _load(path, seed=50):
    probe, probe_opt = cc.wrap(cc.PLAN_B, seed=seed)
    step = ck.load(probe, probe_opt, path)["step"]
    return step, ck.full_state_dict(probe)


def _assert_loads(path, step, reference):
    got_step, full = _load(path)
    assert got_step == step
    assert list(full) == list(reference)
    for key in reference:
        assert torch.equal(full[key], reference[key]), key


@pytest.fixture
def v1(tmp_path):
    """A model, its optimizer, a checkpoint of it at step 1 and that state."""
    model, opt = cc.wrap(cc.PLAN_A)
    path = str(tmp_path / "ckpt")
    ck.save(model, opt, path, step=1)
    state = ck.full_state_dict(model)
    cc.train(model, opt, range(1))  # the model moves on: later saves differ from v1
    return model, opt, path, state


def test_crash_between_the_fallback_renames(v1, tmp_path, monkeypatch):
    model, opt, path, state1 = v1
    backup = str(tmp_path / ".ckpt.osdp-old")
    monkeypatch.setattr(_atomic, "exchange_dirs", lambda a, b: False)
    with monkeypatch.context() as m:
        m.setattr(_atomic, "os", _OsRenameHook(_onto(path, _Died())))
        with pytest.raises(_Died):
            ck.save(model, opt, path, step=2)
    assert not os.path.exists(path) and os.path.isdir(backup), "the state a crash between the renames leaves"

    # load names the backup and how to restore it
    with pytest.raises(OSDPError) as info:
        _load(path)
    message = str(info.value)
    assert backup in message and f"mv {backup} {path}" in message, message

    # the next save puts the backup back first: if it crashes too, v1 is at the path
    def crash(tmp, target):
        raise RuntimeError("simulated crash before the rename")

    with monkeypatch.context() as m:
        m.setattr(_atomic, "replace_dir", crash)
        with pytest.raises(RuntimeError, match="simulated crash"):
            ck.save(model, opt, path, step=2)
    _assert_loads(path, 1, state1)

    # and a save that completes leaves nothing beside the checkpoint
    ck.save(model, opt, path, step=3)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    _assert_loads(path, 3, ck.full_state_dict(model))


def test_failed_second_rename_puts_the_previous_checkpoint_back(v1, tmp_path, monkeypatch):
    model, opt, path, state1 = v1
    monkeypatch.setattr(_atomic, "exchange_dirs", lambda a, b: False)
    with monkeypatch.context() as m:
        m.setattr(_atomic, "os", _OsRenameHook(_onto(path, PermissionError(13, "simulated", path))))
        with pytest.raises(PermissionError, match="simulated"):
            ck.save(model, opt, path, step=2)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    _assert_loads(path, 1, state1)


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "fallback"])
def test_stale_backup_is_removed_by_the_next_save(v1, tmp_path, monkeypatch, exchange):
    model, opt, path, state1 = v1
    # a crash after the second rename, before the backup was deleted: both complete
    shutil.copytree(path, str(tmp_path / ".ckpt.osdp-old"))
    _assert_loads(path, 1, state1)  # the checkpoint at the path is the one loaded
    if not exchange:
        monkeypatch.setattr(_atomic, "exchange_dirs", lambda a, b: False)
    ck.save(model, opt, path, step=2)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    _assert_loads(path, 2, ck.full_state_dict(model))

"""Auto mode on a model built on the meta device, one trial at a time, within a time
budget, with progress lines and a cache of measured plans ([Note: one trial at a time],
[Note: planning budget], [Note: measured plan cache])."""
from __future__ import annotations

import logging

import pytest
import torch

import osdp
from osdp.models import GPT, GPTConfig, example_batch
from osdp.planner import profile_cache
from osdp.profiler import plans as runtime_profiler

pytestmark = pytest.mark.usefixtures("one_rank_group")

CONFIG = GPTConfig(vocab_size=128, seq_len=16, num_layers=2, hidden=32, heads=4)


def meta_gpt():
    with torch.device("meta"):
        return GPT(CONFIG)


def auto(model, cache_dir, **extra):
    return osdp.OSDP(model, memory_limit="24MiB", example_inputs=example_batch(CONFIG, 4),
                     param_init_fn=GPT.init_module,
                     auto_kwargs={"cache_dir": cache_dir, "budget_s": 20, **extra})


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture(scope="module")
def first_build(one_rank_group, tmp_path_factory):
    """The first auto-mode build on an empty cache (it measures, then caches its plan),
    its osdp log records and the cache directory: one build for the two tests below
    that read them (a build measures for several seconds)."""
    cache_dir = tmp_path_factory.mktemp("auto_meta_cache")
    logger, handler = logging.getLogger("osdp"), _Records()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(profile_cache, "machine_speed", _one_speed)
        try:
            torch.manual_seed(0)
            wrapped = auto(meta_gpt(), cache_dir)
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
    return wrapped, handler.records, cache_dir


def _one_speed(device):
    """The machine's speed, fixed: a busy test machine's changing speed would keep its
    plan out of the cache ([Note: measured plan cache]), not this file's subject."""
    return profile_cache.Speed(1e11, False)


def test_auto_mode_on_meta_initializes_as_a_plain_build_and_trains(first_build):
    wrapped, records, _ = first_build
    torch.manual_seed(0)
    plain = osdp.OSDP(meta_gpt(), default_mode="zdp", param_init_fn=GPT.init_module)
    mine, theirs = wrapped.full_state_dict(), plain.full_state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)  # the draws of a build without auto mode
    assert not any(t.is_meta for t in list(wrapped.parameters()) + list(wrapped.buffers()))
    lines = [r.getMessage() for r in records if r.name.startswith("osdp")]
    for stage in ("described", "measured plan 1:", "planned:", "calibration:", "picked:"):
        assert any(line.startswith(stage) for line in lines), (stage, lines)
    budget = wrapped.plan.calibration.budget
    assert budget["budget_s"] == 20 and budget["spent_s"] > 0
    optim = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    for step in range(2):
        wrapped(*example_batch(CONFIG, wrapped.batch_size, seed=step)).backward()
        optim.step()
        optim.zero_grad()


def test_a_restarted_job_takes_the_measured_plan_from_the_cache(first_build, monkeypatch):
    first, _, tmp_path = first_build
    made = []
    real_init = runtime_profiler._Trial.__init__

    def counting(self, *args):
        made.append(1)
        real_init(self, *args)

    monkeypatch.setattr(runtime_profiler._Trial, "__init__", counting)
    monkeypatch.setattr(profile_cache, "machine_speed", _one_speed)
    torch.manual_seed(0)
    again = auto(meta_gpt(), tmp_path)
    assert again.plan.plan_hash() == first.plan.plan_hash()
    assert made == []  # nothing measured: the plan came from the cache
    monkeypatch.setenv("OSDP_REPROFILE", "1")
    torch.manual_seed(0)
    auto(meta_gpt(), tmp_path)
    assert made  # measured anew when asked to


def test_a_spent_budget_caps_the_batch_and_says_what_it_cut(tmp_path):
    torch.manual_seed(0)
    wrapped = auto(meta_gpt(), tmp_path, budget_s=0.01, use_plan_cache=False)
    cuts = wrapped.plan.calibration.budget["cuts"]
    assert any(cut.startswith("batch capped at") for cut in cuts), cuts
    assert wrapped.plan.measured  # the plan handed out was measured all the same


def test_a_bad_budget_is_refused(tmp_path):
    with pytest.raises(osdp.ConfigError, match="budget_s must be a number of seconds > 0"):
        auto(meta_gpt(), tmp_path, budget_s=-1)

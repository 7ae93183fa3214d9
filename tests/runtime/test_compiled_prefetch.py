"""The compiled path's overlap pass ([Note: compiled prefetch]): its rules on small
graphs of stand-in scheduler nodes, and (slow: inductor compiles C++) the order inductor
emits for a real wrapped model's graphs on a fake 2-rank group (collectives return at
once: this checks the order; tests/runtime/test_compiled.py checks the numbers)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

import osdp
from osdp.models.gpt import GPT, GPTConfig, example_batch
from osdp.runtime.compiled_prefetch import WindowPrefetch


def _tags(snodes) -> str:
    """G gather, R reduction, w wait, . anything else."""
    from torch._inductor.utils import contains_collective, contains_wait

    from osdp.runtime.compiled_prefetch import _is_gather

    return "".join(("G" if _is_gather(s) else "R") if contains_collective(s) else "w" if contains_wait(s) else "."
                   for s in snodes)


def _orders(monkeypatch, tmp_path, **osdp_kwargs) -> list[tuple[str, str]]:
    """(inductor's order, the pass's) of every graph that has collectives, after one
    training step of a 1-layer GPT with every unit zdp."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # cold: every graph runs the pass
    seen = []
    real = WindowPrefetch.__call__

    def recording(self, snodes):
        out = real(self, snodes)
        seen.append((_tags(snodes), _tags(out)))
        return out

    monkeypatch.setattr(WindowPrefetch, "__call__", recording)
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, seq_len=8, num_layers=1, hidden=32, heads=2)
    model = osdp.OSDP(GPT(config), default_mode="zdp",
                      compile={"scope": "blocks", "backend": "inductor", "dynamic": False}, **osdp_kwargs)
    idx, targets = example_batch(config, 2, seed=0)
    model(idx, targets).backward()
    return [(before, after) for before, after in seen if "G" in before or "R" in before]


# ---- the rules, on stand-in nodes ------------------------------------------------------------
@dataclass(frozen=True)
class _Dep:
    name: str
    is_fake: bool = False  # inductor's ordering-only dependency (of a collective on the previous one)


class _SNode:
    """A scheduler node as the pass reads it: kind G (gather), R (reduction), w (wait)
    or . (compute), the buffer it writes (its name) and the ones it reads."""

    def __init__(self, name: str, kind: str, reads: tuple[str, ...] = (), nbytes: int = 0):
        self.name, self.kind = name, kind
        self.unmet_dependencies = {_Dep(r.lstrip("~"), r.startswith("~")) for r in reads}
        op = torch.ops._c10d_functional.all_gather_into_tensor.default if kind == "G" else None
        self.node = SimpleNamespace(op_overload=op, get_layout=lambda: SimpleNamespace(size=[nbytes // 4],
                                                                                        dtype=torch.float32))

    def get_buffer_names(self):
        return {self.name}


@pytest.fixture
def stand_ins(monkeypatch):
    from torch._inductor import utils

    monkeypatch.setattr(utils, "contains_collective", lambda s: s.kind in "GR")
    monkeypatch.setattr(utils, "contains_wait", lambda s: s.kind == "w")


def _graph(spec: str) -> list[_SNode]:
    """``name:kind:reads,...:bytes`` entries, space-separated, in inductor's order; a
    read ``~x`` is an ordering-only dependency."""
    nodes = []
    for entry in spec.split():
        name, kind, reads, nbytes = (entry.split(":") + ["", ""])[:4]
        nodes.append(_SNode(name, kind, tuple(r for r in reads.split(",") if r), int(nbytes or 0)))
    return nodes


def _names(nodes) -> str:
    return " ".join(n.name for n in nodes)


# a block's forward as inductor orders it: each collective ordered after the previous
# one's wait (an ordering-only dependency), a shard rebuilt by a cast; units compute in turn
FORWARD = ("x:. ln:.:x cast1:. g1:G:cast1:400 w1:w:g1 fc:.:ln,w1 gelu:.:fc "
           "g2:G:~w1:400 w2:w:g2 proj:.:gelu,w2")


def test_the_first_gather_starts_the_graph_and_the_next_follows_the_previous_wait(stand_ins):
    out = WindowPrefetch(800)(_graph(FORWARD))
    assert _names(out) == "cast1 g1 x ln w1 g2 fc gelu w2 proj"


def test_a_gather_that_does_not_fit_the_window_beside_the_one_in_use_stays(stand_ins):
    # room for one unit: the first still starts the graph, the second waits its turn
    assert _names(WindowPrefetch(400)(_graph(FORWARD))) == "cast1 g1 x ln w1 fc gelu g2 w2 proj"
    # room for none: inductor's order
    nodes = _graph(FORWARD)
    assert WindowPrefetch(100)(nodes) == nodes


# a backward as inductor orders it: re-gather, gradients, reduction (the average reads
# its wait), then the next unit's re-gather, ordered behind that reduction
BACKWARD = ("dy:. g1:G::400 w1:w:g1 dx:.:dy,w1 dw:.:dy r1:R:dw,~w1 v1:w:r1 avg1:.:v1 "
            "dx2:.:dx g2:G:~v1:400 w2:w:g2 dw2:.:dx2,w2 r2:R:dw2,~w2 v2:w:r2 avg2:.:v2 tail:.:dx2")


def test_a_reduction_runs_under_the_compute_after_it_until_the_next_collective(stand_ins):
    """The next re-gather is issued after the previous one's wait, ahead of the reduction
    between them (the same collective order on every rank); each reduction's wait and
    average come just before the next collective, or at the end."""
    out = WindowPrefetch(800)(_graph(BACKWARD))
    assert _names(out) == "g1 dy w1 g2 dx dw r1 dx2 w2 dw2 v1 avg1 r2 tail v2 avg2"


def test_every_dependency_holds_but_a_raised_gathers_ordering_only_one(stand_ins):
    for spec in (FORWARD, BACKWARD):
        out = WindowPrefetch(800)(_graph(spec))
        done = set()
        for node in out:
            real = {d.name for d in node.unmet_dependencies if not (node.kind == "G" and d.is_fake)}
            assert real <= done, node.name
            done.add(node.name)
    # a gather that reads a reduction's result for real is not raised past it
    real_read = BACKWARD.replace("g2:G:~v1:400", "g2:G:avg1:400")
    out = _names(WindowPrefetch(800)(_graph(real_read)))
    assert out.index("g2") > out.index("avg1")


def test_the_decisions_do_not_depend_on_how_a_rank_rebuilds_its_shard(stand_ins):
    """One rank's shard is a view (no node), another's a cat of pieces and padding: the
    collectives go to the same places relative to the other collectives and waits."""
    other_rank = FORWARD.replace("cast1:. g1:G:cast1:400", "p1:. p2:. cat1:.:p1,p2 cast1:.:cat1 g1:G:cast1:400")
    mine, theirs = (WindowPrefetch(800)(_graph(spec)) for spec in (FORWARD, other_rank))
    assert [n.name for n in mine if n.kind != "."] == [n.name for n in theirs if n.kind != "."]


# ---- a real model through inductor -------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_gathers_prefetch_one_ahead_and_reductions_run_under_compute(fake_world, monkeypatch, tmp_path):
    # every unit of this GPT is small: coalescing would merge its gathers (its own test:
    # tests/runtime/test_compiled.py's coalesced cases); this one reads the pass's order
    orders = _orders(monkeypatch, tmp_path, coalesce_bytes=0)
    forward = [after for before, after in orders if before.count("G") > 2 and "R" not in before]
    assert forward, orders
    for after in forward:
        # the first gather at the start; every later one right after the previous wait
        assert after.startswith("G") and after.count("wG") == after.count("G") - 1, after
    backward = [(before, after) for before, after in orders if before.count("R") > 1]
    assert backward, orders
    for before, after in backward:
        assert not re.search(r"R\.+w", before), before  # inductor waits at once
        assert re.search(r"R\.+w", after), after  # the pass lets compute run under the reduction
        # a re-gather goes ahead of the reduction before it, one unit ahead: GG starts it
        assert after.replace(".", "").replace("w", "").startswith("GG"), after
        assert sorted(before) == sorted(after)

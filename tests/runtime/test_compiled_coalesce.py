"""Which gathers the compiled path merges ([Note: compiled small units coalesced] in
osdp/runtime/compiled_coalesce.py), on small traced graphs over a fake 2-rank group:
eager's rider rule, and the same decisions whatever a rank's shard rebuild looks like.
The merged graphs' numbers: tests/runtime/test_compiled.py's coalesced cases (2 gloo
ranks against eager OSDP and single-process training)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from osdp.runtime.compiled_coalesce import SmallGatherCoalescing

_C10D = torch.ops._c10d_functional
pytestmark = pytest.mark.parametrize("fake_world", [2], indirect=True)


def _gather(shard):
    return _C10D.wait_tensor(_C10D.all_gather_into_tensor(shard, 2, dist.group.WORLD.group_name))


def _graph(body, *shapes, dtypes=None):
    """``body``'s graph, traced with fake tensors of ``shapes`` (fp32 unless ``dtypes``)."""
    dtypes = dtypes or [torch.float32] * len(shapes)
    args = [torch.zeros(shape, dtype=dtype) for shape, dtype in zip(shapes, dtypes)]
    return make_fx(body, tracing_mode="fake")(*args).graph


def _gathered(graph) -> list[int]:
    """The numel each all-gather of ``graph`` returns, in graph order."""
    return [n.meta["val"].numel() for n in graph.nodes if n.target is _C10D.all_gather_into_tensor.default]


def _buckets(graph, coalesce_bytes) -> list[list[int]]:
    """The gathers merged, by their index among the graph's gathers."""
    index = {n: i for i, n in enumerate(n for n in graph.nodes if n.target is _C10D.all_gather_into_tensor.default)}
    return [[index[g] for g in bucket] for bucket in SmallGatherCoalescing(coalesce_bytes).buckets(graph)]


def test_small_gathers_ride_with_the_first_past_the_big_ones_up_to_coalesce_bytes(fake_world):
    # gathered bytes (2 ranks): 256 each but big's 8192
    def body(a, big, b, c, d, e, f):
        return [_gather(a), _gather(big), _gather(b), _gather(c), _gather(d), _gather(e), _gather(f)]

    graph = _graph(body, 32, 1024, 32, 32, 32, 32, 32)
    assert _buckets(graph, 4096) == [[0, 2, 3, 4, 5, 6]]  # small: <= 1024 bytes
    assert _buckets(graph, 1024) == [[0, 2, 3, 4], [5, 6]]  # 4 x 256 fill a bucket
    assert _buckets(graph, 1023) == []  # small: <= 255 bytes
    assert _buckets(graph, 0) == []


def test_the_walk_stops_at_another_dtype_and_at_a_rebuild_that_reads_a_collective(fake_world):
    def mixed(a, b, c):
        return [_gather(a), _gather(b), _gather(c)]

    graph = _graph(mixed, 32, 32, 32, dtypes=[torch.float32, torch.bfloat16, torch.float32])
    assert _buckets(graph, 4096) == []

    def reads_a_gather(a, b):
        first = _gather(a)
        return [first, _gather(b + first[:32])]

    assert _buckets(_graph(reads_a_gather, 32, 32), 4096) == []


def test_the_buckets_do_not_depend_on_how_a_rank_rebuilds_its_shard(fake_world):
    """One rank's shard is a view of one parameter, another's a concatenation of two
    parameters' pieces and padding: the same gathers are merged."""
    def view(p, q, big):
        return [_gather(p[:32]), _gather(big), _gather(torch.split(q, 32)[0]), _gather(p[32:64])]

    def pieces(p, q, big):
        padded = torch.cat([p[:16], q[:8], p.new_zeros(8)])
        return [_gather(padded), _gather(big), _gather(torch.cat([q[:24], p[:8]])), _gather(q[32:64])]

    graphs = [_graph(body, 64, 64, 1024) for body in (view, pieces)]
    assert _buckets(graphs[0], 4096) == _buckets(graphs[1], 4096) == [[0, 2, 3]]


def test_a_merged_graph_gathers_once_and_hands_each_user_its_own_rows(fake_world):
    def body(a, big, b):
        return [_gather(a) * 2, _gather(big), _gather(b) + 1]

    graph = _graph(body, 32, 1024, 16)
    SmallGatherCoalescing(4096)(graph)
    graph.lint()
    assert _gathered(graph) == [2 * 48, 2 * 1024]
    outputs = next(n for n in graph.nodes if n.op == "output").args[0]
    assert [tuple(o.meta["val"].shape) for o in outputs] == [(64,), (2048,), (32,)]

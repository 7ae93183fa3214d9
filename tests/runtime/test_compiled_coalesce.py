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

from osdp.runtime.compiled_coalesce import SmallUnitCoalescing

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
    return [[index[g] for g in bucket] for bucket in SmallUnitCoalescing(coalesce_bytes).gather_buckets(graph)]


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
    SmallUnitCoalescing(4096)(graph)
    graph.lint()
    assert _gathered(graph) == [2 * 48, 2 * 1024]
    outputs = next(n for n in graph.nodes if n.op == "output").args[0]
    assert [tuple(o.meta["val"].shape) for o in outputs] == [(64,), (2048,), (32,)]


def _all_reduce(grad):
    return _C10D.wait_tensor(_C10D.all_reduce(grad, "sum", dist.group.WORLD.group_name))


def _reduce_scatter(grad):
    return _C10D.wait_tensor(_C10D.reduce_scatter_tensor(grad, "sum", 2, dist.group.WORLD.group_name))


def _reduction_buckets(graph, coalesce_bytes) -> list[list[int]]:
    kinds = (_C10D.all_reduce.default, _C10D.reduce_scatter_tensor.default)
    index = {n: i for i, n in enumerate(n for n in graph.nodes if n.target in kinds)}
    return [[index[r] for r in bucket] for bucket in SmallUnitCoalescing(coalesce_bytes).reduction_buckets(graph)]


def test_small_reductions_of_one_kind_are_reduced_together_past_the_big_ones(fake_world):
    # reduced bytes: 256 each but big's 8192; small is <= 1024 of 4096
    def body(a, big, b, c, d):
        return [_all_reduce(a * 2), _all_reduce(big), _all_reduce(b), _reduce_scatter(c), _all_reduce(d)]

    graph = _graph(body, 64, 2048, 64, 64, 64)
    assert _reduction_buckets(graph, 4096) == [[0, 2]]  # the reduce-scatter ends the walk
    assert _reduction_buckets(graph, 0) == []


def test_a_gradient_that_reads_a_reduced_one_ends_the_bucket(fake_world):
    def body(a, b, c):
        first = _all_reduce(a)
        return [first, _all_reduce(b * first), _all_reduce(c)]

    # a's bucket ends at b (no rider: no bucket); b leads the next, and c rides
    assert _reduction_buckets(_graph(body, 64, 64, 64), 4096) == [[1, 2]]


def test_merged_reductions_stand_where_the_last_one_was_and_keep_their_readers_after_it(fake_world):
    def body(a, b, c, d):
        early = _reduce_scatter(a) + 1  # read before the last member's gradient exists
        late = c * 3
        return [early, _reduce_scatter(b), _reduce_scatter(late), _all_reduce(d)]

    graph = _graph(body, 64, 64, 64, 2048)
    before = _as_rank0(_graph(body, 64, 64, 64, 2048))
    SmallUnitCoalescing(4096)(graph)
    graph.lint()  # every node after what it reads
    kinds = [n.target for n in graph.nodes if n.target in (_C10D.all_reduce.default,
                                                           _C10D.reduce_scatter_tensor.default)]
    assert kinds == [_C10D.reduce_scatter_tensor.default, _C10D.all_reduce.default]
    outputs = next(n for n in graph.nodes if n.op == "output").args[0]
    assert [tuple(o.meta["val"].shape) for o in outputs] == [(32,), (32,), (32,), (2048,)]
    # rank 0's part, with the other rank contributing zeros: its own rows of each input
    inputs = [torch.randn(64), torch.randn(64), torch.randn(64), torch.randn(2048)]
    for merged, alone in zip(_as_rank0(graph)(*inputs), before(*inputs)):
        torch.testing.assert_close(merged, alone, rtol=0, atol=0)


def _as_rank0(graph) -> torch.fx.GraphModule:
    """``graph`` runnable on one process: each reduction as rank 0 of 2 sees it when the
    other rank sends zeros (a reduce-scatter keeps rank 0's rows, an all-reduce all)."""
    def reduce_scatter(x, op, world, group):
        return x.view(world, -1)[0].clone()

    swap = {_C10D.reduce_scatter_tensor.default: reduce_scatter, _C10D.wait_tensor.default: lambda x: x,
            _C10D.all_reduce.default: lambda x, op, group: x.clone()}
    for node in graph.nodes:
        node.target = swap.get(node.target, node.target)
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    module.recompile()
    return module

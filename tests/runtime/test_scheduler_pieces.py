"""Unit tests of the runtime scheduler's pieces against a recording fake comm (no
process group): UnitLifecycle (gather state, use counts, transient bytes), PrefetchPolicy
(recorded order, window, riders), GradReducer (queue depth, coalescing, accumulation,
dropping). Every expectation is written from the [Note]s, not read off the code."""
from __future__ import annotations

import torch

from osdp.contract import effective_mode
from osdp.runtime.collectives import Pending
from osdp.runtime.ledger import MemoryLedger
from osdp.runtime.lifecycle import UnitLifecycle
from osdp.runtime.modes import GatherState, Mode
from osdp.runtime.prefetch import PrefetchPolicy
from osdp.runtime.reduce import GradReducer
from osdp.runtime.shard_unit import ParamSlot, ShardUnit

WORLD = 2


class FlatLayout:
    """One level, one node: every mode is itself."""

    @staticmethod
    def effective_mode(mode):
        return effective_mode(mode, WORLD, WORLD)


class FakeComm:
    """Records every collective; a Pending's wait is logged, reductions write rank 0's
    chunk of ``WORLD x`` the input (what a sum over identical ranks gives)."""

    world_size, rank, device = WORLD, 0, torch.device("cpu")
    data_parallel_size = WORLD  # a 1-D layout: no replicas

    def __init__(self):
        self.log: list[tuple] = []
        self.layout = FlatLayout()

    def _pending(self, name, on_wait=None):
        index = len(self.log)
        self.log.append(("issue", name))

        def finish():
            self.log.append(("wait", name, index))
            if on_wait is not None:
                on_wait()

        return Pending(None, (), finish)

    def all_gather(self, output, shard, what, level="shard"):
        return self._pending(what)

    def all_gather_coalesced(self, outputs, shards, what, level="shard", members=()):
        return self._pending(what)

    def reduce_scatter(self, out, full, what):
        return self._pending(what, lambda: out.copy_(full[: out.numel()] * WORLD))

    def reduce_scatter_coalesced(self, outs, fulls, what, members=()):
        def finish():
            for out, full in zip(outs, fulls):
                out.copy_(full[: out.numel()] * WORLD)

        return self._pending(what, finish)

    def issued(self):
        return [entry[1] for entry in self.log if entry[0] == "issue"]


def unit(name: str, numel: int, mode: str = "zdp") -> ShardUnit:
    tensor = torch.arange(numel, dtype=torch.float32)
    slot = ParamSlot("weight", (f"{name}.weight",), tensor.shape, 0, numel)
    return ShardUnit(name, [slot], [tensor], Mode(mode), 0, WORLD, torch.device("cpu"), True,
                     param_names=[f"{name}.weight"])


def bytes_of(u: ShardUnit) -> int:
    return u.gathered_bytes


# ---- UnitLifecycle ---------------------------------------------------------------------
def test_lifecycle_states_and_one_collective_per_unshard():
    comm = FakeComm()
    life = UnitLifecycle(comm, MemoryLedger(torch.device("cpu")))
    a, b = unit("a", 8), unit("b", 8)
    life.unshard([a])
    assert a.state is GatherState.GATHERING and comm.issued() == ["all-gather of unit 'a'"]
    life.unshard([a])  # already gathering: nothing issued
    assert len(comm.issued()) == 1
    life.wait_for_unshard(a)
    assert a.state is GatherState.GATHERED
    life.reshard(a)
    assert a.state is GatherState.SHARDED and a.gathered.untyped_storage().size() == 0
    life.unshard([a, b])  # two units: one coalesced collective, one shared wait
    assert comm.issued()[-1].startswith("coalesced all-gather of 2 units")
    life.wait_for_unshard(a)
    life.wait_for_unshard(b)
    assert sum(1 for e in comm.log if e[0] == "wait") == 2  # 'a' once, the pair once


def test_reshard_waits_for_the_gather_before_freeing():
    comm = FakeComm()
    life = UnitLifecycle(comm, MemoryLedger(torch.device("cpu")))
    a = unit("a", 8)
    life.unshard([a])
    life.reshard(a)
    assert comm.log[-1][0] == "wait" and a.state is GatherState.SHARDED


def test_dp_units_are_kept_and_leave_the_window_zdp_units_are_freed():
    life = UnitLifecycle(FakeComm(), MemoryLedger(torch.device("cpu")))
    dp, zdp = unit("dp", 8, "dp"), unit("zdp", 8, "zdp")
    for u in (dp, zdp):
        life.unshard([u])
        life.wait_for_unshard(u)
        life.begin_forward_use(u)
    assert life.transient_bytes() == bytes_of(dp) + bytes_of(zdp)
    for u in (dp, zdp):
        life.end_forward_use(u, expects_backward=True)
    # [Note: unit lifetime]: dp kept until its backward, zdp freed; kept bytes are not transient
    assert dp.state is GatherState.GATHERED and zdp.state is GatherState.SHARDED
    assert life.transient_bytes() == 0
    assert life.transient_bytes(counting=dp) == bytes_of(dp)
    life.begin_backward_use(dp, was_awaiting=True)
    assert life.transient_bytes() == bytes_of(dp)
    life.end_backward_use(dp, was_active=True, was_awaiting=False)
    life.maybe_reshard(dp)
    assert dp.state is GatherState.SHARDED and life.transient_bytes() == 0


def test_reset_frees_everything_and_clears_counts():
    life = UnitLifecycle(FakeComm(), MemoryLedger(torch.device("cpu")))
    units = [unit("a", 8, "dp"), unit("b", 8)]
    for u in units:
        life.unshard([u])
        life.begin_forward_use(u)
    life.reset(units)
    assert all(u.state is GatherState.SHARDED and u.n_active == u.n_await == 0 for u in units)
    assert life.transient_bytes() == 0 and life.gathered_units() == []


# ---- PrefetchPolicy ----------------------------------------------------------------------
def _recorded(policy: PrefetchPolicy, units, expects=True):
    policy.begin_forward(grad_enabled=True)
    for u in units:
        entry = policy.record_forward_use(u)
        entry[1] = expects
    policy.end_forward()


def test_small_units_do_not_ride_beyond_the_window():
    comm = FakeComm()
    life = UnitLifecycle(comm, MemoryLedger(torch.device("cpu")))
    small = [unit(f"ln{i}", 4) for i in range(3)]
    policy = PrefetchPolicy(life, window_bytes=2 * 16, coalesce_bytes=64)
    policy.mark_coalescible(small)
    _recorded(policy, small)
    policy.begin_forward(grad_enabled=True)
    policy.gather_for_forward(small[0], in_forward=True)
    # riders are prefetches: ln0 + ln1 fill the 32-byte window, ln2 waits for its turn
    assert comm.issued() == ["coalesced all-gather of 2 units ('ln0', 'ln1')"]


def test_window_prefetches_in_order_and_stops_at_the_first_that_does_not_fit():
    comm = FakeComm()
    life = UnitLifecycle(comm, MemoryLedger(torch.device("cpu")))
    a, b, c, d = unit("a", 8), unit("b", 16), unit("c", 4), unit("d", 4)
    policy = PrefetchPolicy(life, window_bytes=bytes_of(a) + bytes_of(c), coalesce_bytes=0)
    _recorded(policy, [a, b, c, d])
    policy.begin_forward(grad_enabled=True)
    policy.gather_for_forward(a, in_forward=True)
    # a is gathered; b (16) does not fit beside a (8) in a window of 12: stop, even
    # though c (4) would fit: gathers go out in use order on every rank
    assert comm.issued() == ["all-gather of unit 'a'"]
    assert policy.forward_order == [a, b, c, d]
    assert policy.backward_order == [d, c, b, a]


def test_window_of_two_units_overlaps_the_next_gather():
    comm = FakeComm()
    life = UnitLifecycle(comm, MemoryLedger(torch.device("cpu")))
    a, b, c = unit("a", 8), unit("b", 8), unit("c", 8)
    policy = PrefetchPolicy(life, window_bytes=2 * bytes_of(a), coalesce_bytes=0)
    _recorded(policy, [a, b, c])
    policy.begin_forward(grad_enabled=True)
    policy.gather_for_forward(a, in_forward=True)
    assert comm.issued() == ["all-gather of unit 'a'", "all-gather of unit 'b'"]


def test_small_units_ride_along_within_coalesce_bytes_and_the_window():
    comm = FakeComm()
    life = UnitLifecycle(comm, MemoryLedger(torch.device("cpu")))
    small = [unit(f"ln{i}", 4) for i in range(5)]  # 4 floats: 16 bytes gathered
    big = unit("big", 64)
    # small: gathered bytes <= coalesce_bytes / 4 = 16
    policy = PrefetchPolicy(life, window_bytes=1 << 20, coalesce_bytes=64)
    policy.mark_coalescible(small + [big])
    assert all(u.coalescible for u in small) and not big.coalescible
    _recorded(policy, [small[0], small[1], big, small[2], small[3], small[4]])
    policy.begin_forward(grad_enabled=True)
    policy.gather_for_forward(small[0], in_forward=True)
    # small[0] takes the next small units of the order (passing over the big one) while
    # the group fits coalesce_bytes: 4 x 16 = 64 bytes, the fifth stays; then the big
    # unit and ln4 are prefetched (the window is large)
    assert comm.issued() == [
        "coalesced all-gather of 4 units ('ln0', 'ln1', 'ln2', 'ln3')", "all-gather of unit 'big'",
        "all-gather of unit 'ln4'",
    ]


# ---- GradReducer -----------------------------------------------------------------------
def _fill_grad(reducer: GradReducer, u: ShardUnit, value: float):
    views, accumulate = reducer.grad_buffer(u)
    for view in views:
        view.add_(value) if accumulate else view.fill_(value)


def test_one_reduce_scatter_in_flight_and_results_averaged_into_param_grads():
    comm = FakeComm()
    reducer = GradReducer(comm, MemoryLedger(torch.device("cpu")), coalesce_bytes=0)
    a, b = unit("a", 6), unit("b", 6)
    _fill_grad(reducer, a, 1.0)
    reducer.reduce(a)
    assert [e[0] for e in comm.log] == ["issue"]  # a in flight, not waited
    _fill_grad(reducer, b, 2.0)
    reducer.reduce(b)  # a second one in flight: the oldest (a) is waited first
    assert [e[0] for e in comm.log] == ["issue", "issue", "wait"] and comm.log[2][1] == "reduce-scatter of unit 'a'"
    reducer.finish()
    # rank 0's chunk of the sum over 2 identical ranks, averaged: the local gradient
    assert torch.equal(a.params[0].grad, torch.full((3,), 1.0)) and torch.equal(b.params[0].grad, torch.full((3,), 2.0))
    assert a.grad_flat is None and b.grad_flat is None


def test_small_units_reduce_together_at_coalesce_bytes_or_at_finish():
    comm = FakeComm()
    small = [unit(f"ln{i}", 4) for i in range(3)]
    grad_bytes = 4 * 4
    reducer = GradReducer(comm, MemoryLedger(torch.device("cpu")), coalesce_bytes=2 * grad_bytes)
    for u in small:
        u.coalescible = True
    _fill_grad(reducer, small[0], 1.0)
    reducer.reduce(small[0])
    assert comm.issued() == []  # waits for more
    _fill_grad(reducer, small[1], 1.0)
    reducer.reduce(small[1])  # 2 x 16 bytes reach coalesce_bytes: one collective
    assert comm.issued() == ["coalesced reduce-scatter of 2 units ('ln0', 'ln1')"]
    _fill_grad(reducer, small[2], 1.0)
    reducer.reduce(small[2])
    reducer.finish()  # the last one goes at the end, alone
    assert comm.issued()[-1] == "reduce-scatter of unit 'ln2'"
    assert all(torch.equal(u.params[0].grad, torch.ones(2)) for u in small)


def test_accumulation_without_sync_keeps_fp32_gradients_and_adds():
    reducer = GradReducer(FakeComm(), MemoryLedger(torch.device("cpu")), coalesce_bytes=0)
    reducer.sync_gradients = False
    a = unit("a", 6)
    _fill_grad(reducer, a, 1.0)
    _fill_grad(reducer, a, 2.0)
    assert a.grad_flat.dtype == torch.float32 and torch.equal(a.grad_flat[:6], torch.full((6,), 3.0))


def test_drop_waits_for_what_was_issued_and_keeps_nothing():
    comm = FakeComm()
    ledger = MemoryLedger(torch.device("cpu"))
    reducer = GradReducer(comm, ledger, coalesce_bytes=0)
    a, b = unit("a", 6), unit("b", 6)
    _fill_grad(reducer, a, 1.0)
    reducer.reduce(a)
    _fill_grad(reducer, b, 1.0)  # unsharded, never reduced
    reducer.drop([a, b])
    assert comm.log[-1][0] == "wait"
    assert a.params[0].grad is None and b.grad_flat is None
    assert ledger.stats()["current_grad_bytes"] == 0

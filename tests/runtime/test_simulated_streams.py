"""The CUDA-stream path of the runtime (comm streams, events, waits, frees), run on CPU
through ``SimulatedStreams`` ([Note: simulated streams] in osdp/runtime/streams.py):
every collective runs on a comm worker thread after a random delay, events complete
only after their work, waits block until then. A missing wait reads a buffer the
delayed collective has not written (parity fails); an early free releases a buffer it
still uses (the collective raises). Parity and ledger checks as test_parity.py, on 2
gloo ranks against single-process training."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from osdp.runtime.streams import SimulatedStreams

from . import parity_cases as pc
from .dist_harness import spawn

CASES = ("random", "random_no_coalesce", "split_mixed", "checkpoint_split", "tied_random", "twice_zdp")
_RESULTS: list = []


def _run(rank, world, names):
    import os

    os.environ["OSDP_SIMULATE_STREAMS"] = "4"  # at most 4 ms of delay per comm work item
    os.environ["OSDP_SIMULATE_SEED"] = str(rank)  # ranks' delays differ
    return pc.run_all(rank, world, names)


def results():
    if not _RESULTS:
        names = [c.name for c in pc.CASES if c.name in CASES]
        assert sorted(names) == sorted(CASES), "parity_cases renamed a case this test runs"
        _RESULTS.extend(spawn(_run, 2, names))
    return _RESULTS


@pytest.mark.parametrize("name", CASES)
def test_parity_and_ledger_through_simulated_streams(name):
    rank0 = results()[0]
    case = {c.name: c for c in pc.CASES}[name]
    losses, state, probe = rank0["osdp"][name]
    ref_losses, ref_state = rank0["ref"][case.model]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for key in ref_state:
        torch.testing.assert_close(state[key], ref_state[key], rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")
    assert probe["gathered_after_backward"] == [] and probe["grad_bytes_after_backward"] == 0


def test_simulated_event_completes_only_after_its_work():
    streams = SimulatedStreams(delay_s=0.05, seed=0)
    stream = streams.new_stream("comm")
    seen = []
    event = streams.run(stream, lambda: seen.append("work"))
    assert not event.is_set(), "the work is delayed: its event cannot be complete yet"
    streams.wait(event)
    assert seen == ["work"]
    order = []
    events = [streams.run(stream, lambda i=i: order.append(i)) for i in range(5)]
    streams.wait(events[-1])  # one worker, issue order: waiting for the last means all ran
    assert order == [0, 1, 2, 3, 4] and all(e.is_set() for e in events)


def test_simulated_stream_reports_a_failed_work_item_to_the_waiter():
    streams = SimulatedStreams(delay_s=0.0)

    def boom():
        raise ValueError("collective failed")

    event = streams.run("comm", boom)
    with pytest.raises(ValueError, match="collective failed"):
        streams.wait(event)


def test_wait_blocks_the_compute_thread():
    streams = SimulatedStreams(delay_s=0.0)
    gate = threading.Event()
    event = streams.run("comm", lambda: gate.wait(5))
    timer = threading.Timer(0.2, gate.set)
    timer.start()
    start = time.perf_counter()
    streams.wait(event)
    assert time.perf_counter() - start >= 0.15

"""Comm streams and events behind one small interface, with two implementations: CUDA
streams, and a CPU simulation that runs comm work asynchronously so that the CUDA
path's ordering rules can be tested on a machine without a GPU.

The interface (what ``CommContext`` uses)::

    streams.new_stream(name)         # a comm stream
    streams.wait_for_compute(stream)  # later work on ``stream`` runs after compute so far
    event = streams.run(stream, work) # enqueue ``work`` on ``stream``; the event completes after it
    streams.wait(event)              # compute runs on only after ``event`` completed
    streams.synchronize()            # the host waits for everything issued

[Note: simulated streams]
``SimulatedStreams`` keeps the CUDA contract and makes its violations visible: compute
runs on the calling thread (in program order, as a CUDA compute stream), comm work runs
on ONE worker thread in issue order (so collectives reach the process group in the same
order on every rank, as NCCL needs), after an injected delay per work item (seeded,
``delay_s`` at most). An event completes only when the work enqueued before it has run,
and ``wait`` blocks the compute thread until then (bounded by ``timeout_s``). A missing
``wait`` makes compute read a buffer the delayed collective has not written yet (wrong
values: parity fails); an early free releases a buffer the delayed collective still
writes or reads (a storage of size 0: the collective raises). Turned on with
``OSDP_SIMULATE_STREAMS=<max delay in ms>`` (or ``CommContext(streams=...)``).
"""
from __future__ import annotations

import os
import queue
import random
import threading
import time

import torch


class CudaStreams:
    """The real thing: high-priority comm streams, CUDA events."""

    def __init__(self, device: torch.device):
        self.device = device

    def new_stream(self, name: str):
        # high priority, so comm kernels are not queued behind compute
        return torch.cuda.Stream(device=self.device, priority=-1)

    def wait_for_compute(self, stream) -> None:
        stream.wait_stream(torch.cuda.current_stream(self.device))

    def run(self, stream, work):
        with torch.cuda.stream(stream):
            work()
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def wait(self, event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()


class SimulatedStreams:
    """See [Note: simulated streams]."""

    def __init__(self, delay_s: float = 0.002, seed: int = 0, timeout_s: float = 300.0):
        self.delay_s = float(delay_s)
        self.timeout_s = float(timeout_s)
        self._random = random.Random(seed)
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._worker = threading.Thread(target=self._loop, name="osdp-simulated-comm-stream", daemon=True)
        self._worker.start()

    def new_stream(self, name: str):
        return name  # one worker runs every comm stream, in issue order

    def wait_for_compute(self, stream) -> None:
        return None  # compute is synchronous: everything it issued has run

    def run(self, stream, work):
        done = threading.Event()
        self._queue.put((self._random.uniform(0.0, self.delay_s), work, done))
        return done

    def wait(self, event) -> None:
        if not event.wait(self.timeout_s):
            raise TimeoutError(f"simulated comm stream: work not done within {self.timeout_s:g} s")
        if self._error is not None:  # the failed work's own error (it names the collective)
            raise self._error

    def synchronize(self) -> None:
        self.wait(self.run(None, lambda: None))

    def _loop(self) -> None:
        while True:
            delay, work, done = self._queue.get()
            time.sleep(delay)
            try:
                if self._error is None:
                    work()
            except BaseException as exc:  # noqa: BLE001 - reported to the next waiter
                self._error = exc
            done.set()


def streams_for(device: torch.device, timeout_s: float):
    """CUDA streams on CUDA; simulated ones where ``OSDP_SIMULATE_STREAMS`` (max delay,
    ms) is set; None otherwise (gloo's own asynchronous collectives)."""
    if device.type == "cuda":
        return CudaStreams(device)
    delay_ms = os.environ.get("OSDP_SIMULATE_STREAMS")
    if delay_ms:
        return SimulatedStreams(float(delay_ms) / 1000.0, seed=int(os.environ.get("OSDP_SIMULATE_SEED", "0")),
                                timeout_s=timeout_s)
    return None

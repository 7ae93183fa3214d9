"""Whether the ranks issued the same collectives: the end-of-backward check.

[Note: lockstep check]
Ranks out of step fail loudly when the collectives differ in size (gloo aborts the
process, "Received data size doesn't match"; a rank waiting on a collective its peer
never issues raises ``CollectiveTimeoutError``), but not when they happen to match: two
layers of one shape, each skipped on one rank, reduce each other's gradients, and the
step goes on with wrong ones. So every rank keeps a running hash of the collectives it
issues (each one's description, which names its unit(s), and its size:
:class:`IssueLog`, fed by ``CommContext``). At the end of each backward pass, once the
step's last reductions are issued, the ranks start comparing their hashes (one
all-gather of an int64 over every rank of the layout, on a gloo group of their own: CPU
tensors, so that CUDA does not synchronize for it, and apart from the runtime's groups);
the scheduler waits for the reductions, finishes the step (nothing gathered, nothing in
flight), then waits for the comparison, whose latency hid behind the reductions. The
same all-gather carries the optimizer steps each rank took on the model's parameters
since the last check ([Note: optimizer steps in lockstep] in optimizer_steps.py).
Unequal hashes raise :class:`RanksOutOfStepError` out of ``backward()`` on every rank,
naming the first collective where the ranks differ: ``.grad`` holds wrong gradients,
and the error comes before the optimizer could step on them. The hash covers everything
since the last check, forwards without backward included. Cost: one small collective a
backward, overlapped (``lockstep_check=False`` or ``OSDP_LOCKSTEP_CHECK=0`` turns it
off; bench/lockstep_overhead.py). The compiled path's collectives are in its graphs,
not issued through ``CommContext``: not checked.
"""
from __future__ import annotations

import hashlib
import weakref
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..errors import CollectiveTimeoutError, RanksOutOfStepError
from .mesh import group_over_ranks_of
from .optimizer_steps import OptimizerSteps, uneven_steps_message

KEPT_ENTRIES = 4096  # descriptions kept for the error message; the hash covers all
FOLD_ENTRIES = 1024  # notes hashed together


class IssueLog:
    """This rank's collectives since the last check: a hash of each one's description,
    size and units, and the first ``KEPT_ENTRIES`` descriptions (for the message). A note
    only appends; the text is built and hashed in batches of ``FOLD_ENTRIES`` (bounded
    memory over forwards without backward) and at the check."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.digest = b""
        self.count = 0
        self.entries: list[str] = []
        self._notes: list[tuple] = []

    def note(self, what: str, numel: int, members: tuple[str, ...] = ()) -> None:
        """One collective: its description, its size, and ``members``, the names of the
        units it carries that its description does not list."""
        self._notes.append((what, numel, members))
        if len(self._notes) >= FOLD_ENTRIES:
            self._fold()

    def _fold(self) -> None:
        texts = [f"{what} ({numel} elements)" + (f" [units {', '.join(members)}]" if members else "")
                 for what, numel, members in self._notes]
        self._notes = []
        self.digest = hashlib.blake2b(self.digest + "\n".join(texts).encode() + b"\n", digest_size=8).digest()
        self.count += len(texts)
        self.entries.extend(texts[:max(0, KEPT_ENTRIES - len(self.entries))])

    def value(self) -> int:
        """The hash as an int64, the count folded in (an empty log is 0)."""
        self._fold()
        if not self.count:
            return 0
        return int.from_bytes(hashlib.blake2b(self.digest + str(self.count).encode(), digest_size=8).digest(),
                              "little", signed=True)

    def described(self) -> list[str]:
        """The first ``KEPT_ENTRIES`` descriptions."""
        self._fold()
        return self.entries


# the layout's world group -> the gloo group beside it that the check runs on (one per
# process and group, however many models; gone with the group)
_CHECK_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class LockstepCheck:
    """Compares the ranks' :class:`IssueLog` at the end of each backward pass ([Note:
    lockstep check]), and the optimizer steps counted by ``steps`` ([Note: optimizer
    steps in lockstep] in optimizer_steps.py). Built on every rank of ``group`` alike
    (it may create the gloo group it compares on)."""

    def __init__(self, group, timeout_s: float, steps: OptimizerSteps | None = None):
        self.log = IssueLog()  # CommContext.issued: what this rank issues until the next check
        self.steps = steps
        self.timeout_s = float(timeout_s)
        self.group = self._check_group(group)

    @staticmethod
    def applies_to(group) -> bool:
        """The backends OSDP runs on: gloo, NCCL (not a fake or custom process group,
        whose collectives move no data to compare)."""
        backend = str(dist.get_backend(group))
        return "gloo" in backend or "nccl" in backend

    def _check_group(self, group):
        """A gloo group over ``group``'s ranks, apart from it: CPU tensors (no device
        synchronization beside NCCL), and never interleaved with the runtime's own
        collectives (which a stream's thread may be issuing meanwhile)."""
        found = _CHECK_GROUPS.get(group)
        if found is None:
            found = group_over_ranks_of(group, backend="gloo", timeout_s=self.timeout_s)
            _CHECK_GROUPS[group] = found
        return found

    def start(self) -> "PendingCheck":
        """Issue the comparison of everything logged so far and of the optimizer steps
        counted since the last check (both start over: what comes after this belongs to
        the next check)."""
        steps = self.steps.take() if self.steps is not None else 0
        mine = torch.tensor([self.log.value(), steps], dtype=torch.int64)
        entries = self.log.described()
        self.log.reset()
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        return PendingCheck(dist.all_gather(every, mine, group=self.group, async_op=True), every, entries)

    def skip(self) -> None:
        """Forget what was logged and counted since the last check, comparing nothing (a
        step whose collectives are stood in for: bench/physical_limit.py)."""
        self.log.reset()
        if self.steps is not None:
            self.steps.take()

    def finish(self, pending: "PendingCheck | None") -> None:
        """Wait for the comparison; ranks out of step raise :class:`RanksOutOfStepError`."""
        if pending is None:
            return
        rank = dist.get_rank(self.group)
        try:
            pending.work.wait(timedelta(seconds=self.timeout_s))
        except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError / DistBackendError
            raise CollectiveTimeoutError(
                f"rank {rank}: the lockstep check at the end of backward did not complete within "
                f"timeout_s={self.timeout_s:g} (a peer rank died, hangs, or runs a different step): "
                f"{type(exc).__name__}: {str(exc).strip()[:200]}") from exc
        steps = [int(t[1]) for t in pending.every]
        if len(set(steps)) > 1:  # the root cause: the collectives after it are alike
            raise RanksOutOfStepError(uneven_steps_message(steps, rank))
        if len({int(t[0]) for t in pending.every}) == 1:
            return
        logs = [None] * len(pending.every)
        dist.all_gather_object(logs, pending.entries, group=self.group)
        raise RanksOutOfStepError(out_of_step_message(logs, rank))


class PendingCheck(NamedTuple):
    work: object  # the all-gather's Work
    every: list  # every rank's (hash, optimizer steps), once it is done
    entries: list  # this rank's descriptions, for the message


def out_of_step_message(logs: list[list[str]], rank: int) -> str:
    """Where the ranks' collectives first differ, for :class:`RanksOutOfStepError`."""
    index = next((i for i in range(max(map(len, logs))) if len({tuple(log[i:i + 1]) for log in logs}) > 1), None)
    if index is None:
        where = (f"beyond the first {KEPT_ENTRIES} collectives of the step (the ranks agree on those)")
    else:
        issued = "; ".join(f"rank {r}: {log[index] if index < len(log) else 'nothing more'}"
                           for r, log in enumerate(logs))
        where = f"at collective {index} of the step, {issued}"
    return (
        f"rank {rank}: the ranks issued different collectives this step ({where}): their models ran different "
        "modules, or in another order, so shards were exchanged between different units and the gradients in "
        ".grad are wrong: call optimizer.zero_grad(), do not step on them. Every rank must call the same modules "
        "in the same order: make a mixture of experts' block one unit with leaf_modules=(its class,) (its experts "
        "gathered together, whatever the routing calls), or call every expert on every rank, one routed no tokens "
        "on its empty slice of them; layers skipped at random must be skipped alike on every rank. See [Note: ranks in "
        "lockstep] in osdp/runtime/lockstep.py. lockstep_check=False (or OSDP_LOCKSTEP_CHECK=0) turns this "
        "check off"
    )

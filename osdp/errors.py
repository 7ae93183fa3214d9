"""Typed errors of the public API. The CLI turns them into one-line messages."""
from __future__ import annotations


class OSDPError(Exception):
    """Base of every error OSDP raises on purpose (bad input, impossible request)."""


class ConfigError(OSDPError, ValueError):
    """A configuration value that is out of range or unknown."""


class InfeasiblePlanError(OSDPError):
    """No plan fits the memory limit, even at batch size 1.

    ``min_bytes`` is the smallest limit that would fit and ``breakdown`` the memory
    breakdown (name -> bytes) of that smallest plan."""

    def __init__(self, message: str, min_bytes: float | None = None, breakdown: dict | None = None):
        super().__init__(message)
        self.min_bytes = min_bytes
        self.breakdown = dict(breakdown or {})


class PlanMismatchError(OSDPError):
    """A plan (or checkpoint) made for another model, world size or version."""


class CollectiveTimeoutError(OSDPError):
    """A collective did not finish within the timeout, or failed because a peer is gone."""


class RanksOutOfStepError(OSDPError):
    """The ranks issued different collectives in a step (their models ran different
    modules): see [Note: lockstep check] in osdp/runtime/lockstep_check.py."""


class MemoryLimitExceeded(OSDPError):
    """A training step's measured peak memory went over the memory limit the model was
    wrapped with (the plan's ``memory_limit_bytes`` or ``OSDP(memory_limit=...)``).

    Raised at the end of the step (the optimizer step's post-hook, the next forward, or
    ``model.end_step()``). ``step`` is the runtime's ``osdp.runtime.peak.StepMemory``
    of that step: ``peak_bytes``, ``limit_bytes``, ``predicted_peak_bytes``,
    ``unit_at_peak``, ``source``. See [Note: measured peak] in osdp/runtime/peak.py."""

    def __init__(self, message: str, step=None):
        super().__init__(message)
        self.step = step


class MemoryFragmentationWarning(UserWarning):
    """On CUDA, the caching allocator held (reserved) more than the memory limit at its
    peak although the allocated bytes stayed within it: fragmentation or cached blocks
    (see [Note: measured peak] in osdp/runtime/peak.py)."""


class FrozenPlanWarning(UserWarning):
    """A unit the plan priced frozen trains: its gradient, optimizer state and reductions
    are in neither the plan's memory nor its time (see [Note: units planned frozen] in
    osdp/runtime/trainable.py)."""


class NoisyProfileWarning(UserWarning):
    """A profile measurement stayed noisy (its repeats spread more than the threshold)
    after the bounded re-measures; the entry is used but not cached as steady (see
    [Note: profile cache] in osdp/planner/profile_cache.py)."""


class ProfileCacheWarning(UserWarning):
    """The profile cache file could not be read (corrupt, another version) and is
    rewritten; nothing from it is used."""


class CheckpointCorruptedError(OSDPError):
    """A checkpoint's stored data is not what was saved: a chunk whose checksum differs,
    a truncated data file, or DCP metadata that does not match the data files."""


class UnverifiedCheckpointWarning(UserWarning):
    """A checkpoint was loaded without verifying its data (written before checksums)."""


class OldClusterFormatWarning(FutureWarning):
    """A cluster file in the format from before hardware and run were apart (it carries
    ``world_size`` / ``memory_limit_bytes``): it is converted on load, and the warning
    says what each old field became (see [Note: old cluster files] in
    ``osdp/planner/cluster.py``)."""


def a_type(value) -> str:
    """'a str', 'an int': the type of ``value`` for messages ("got 'x' (a str)")."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"

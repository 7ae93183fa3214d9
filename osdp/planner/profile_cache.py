"""The profiler's on-disk cache, and the noise check of what goes into it.

    cache = ProfileCache.open(cache_dir)          # $OSDP_CACHE_DIR or ~/.cache/osdp
    key = machine_key(device, "torch.float32", "gloo")
    fit = cache.get("compute", f"{key}|{shape}")  # None: missing, expired or bypassed
    cache.put("compute", f"{key}|{shape}", {...}); cache.save()

[Note: profile cache]
Where: ``<dir>/profile-cache.json`` with ``<dir>`` the ``cache_dir`` argument, else
``$OSDP_CACHE_DIR``, else ``~/.cache/osdp``. One JSON object: ``version`` and sections
(``comm``, ``compute``, ``split``) of entries ``{"value": ..., "saved_s": unix time,
"speed": FLOP/s}`` (the machine's speed stamp, below).

Keys: every entry's key starts with :func:`machine_key`: host name, processor (the GPU's
name on CUDA, the CPU model and core count otherwise), torch version, dtype and
process-group backend; the profiler appends what else the number depends on (world
size and gradient collective, unit shape, split shape). A measurement from another
machine, torch or dtype is never read.

Expiry: an entry older than ``max_age_s`` (default 7 days, ``$OSDP_PROFILE_MAX_AGE_S``;
0 expires everything) is a miss, dropped at the next save: drivers, clocks and other
tenants change under a cache.

Bypass: ``reprofile=True`` (``osdp demo --reprofile``) or ``$OSDP_REPROFILE=1`` reads
nothing and still writes the fresh measurements.

Noise: :func:`steady` takes a measurement as a list of repeats and re-measures while
the relative spread ``(max - min) / median`` is above ``threshold`` (default 25%,
``$OSDP_PROFILE_NOISE``), at most ``retries`` times (default 2); it keeps the steadiest
attempt and, when even that is noisy, warns with its spread (``NoisyProfileWarning``)
and reports it noisy: the profiler then uses it for this run but does not cache it.

Speed: a number measured under other load than now misleads the plan as surely as one
from another machine, and it does so consistently (a busy machine's repeats can agree),
so the noise check does not catch it. So every profile times a fixed matmul
(:func:`machine_speed`, every rank at once, as the units are timed) when it opens the
cache and again before it writes: each entry is stamped with the slower of the two
rates, and is read only while the rate now is within ``speed_tolerance`` of its stamp
(default 25%, ``$OSDP_PROFILE_SPEED_TOLERANCE``), in either direction. Faster now:
the entry was measured under load (another job, or more ranks of this machine
contending for its cores). Slower now: this run computes under more load than the
entry saw, and will train under it too. Either way it is measured again. A profile
whose two stamps disagree by more than the tolerance, or either of which stayed noisy,
ran under changing load: it is used for this plan and not cached. An entry without a
stamp (written by an older osdp) is measured again.

Corruption: a file that is not JSON, not an object, of another version or with
malformed entries is ignored with a ``ProfileCacheWarning`` and rewritten at the next
save. Saves write a temporary file beside the cache and ``os.replace`` it: a crash or
a concurrent writer never leaves half a file (the last writer wins).
"""
from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from ..errors import NoisyProfileWarning, OSDPError, ProfileCacheWarning

CACHE_VERSION = 3
SECTIONS = ("comm", "compute", "split")
DEFAULT_MAX_AGE_S = 7 * 24 * 3600.0
DEFAULT_NOISE_THRESHOLD = 0.25
DEFAULT_NOISE_RETRIES = 2
CACHE_FILE = "profile-cache.json"
DEFAULT_SPEED_TOLERANCE = 0.25
# the reference matmul's side per device type: about a millisecond at full speed, long
# enough to time, short enough to measure at every profile
SPEED_MATMUL_SIDE = {"cuda": 4096}
SPEED_MATMUL_SIDE_DEFAULT = 512


# ---- where, and whether ----------------------------------------------------------------

def cache_dir(directory=None) -> Path:
    """``directory``, else ``$OSDP_CACHE_DIR``, else ``~/.cache/osdp``."""
    return Path(directory or os.environ.get("OSDP_CACHE_DIR") or Path.home() / ".cache" / "osdp")


def cache_path(directory=None) -> Path:
    return cache_dir(directory) / CACHE_FILE


def reprofile_requested(reprofile: bool = False) -> bool:
    """``reprofile`` or ``$OSDP_REPROFILE=1``: measure again, read no cache."""
    return bool(reprofile) or os.environ.get("OSDP_REPROFILE", "0").strip() == "1"


def _env_number(name: str, default: float) -> float:
    text = os.environ.get(name)
    if text is None or not text.strip():
        return default
    try:
        value = float(text)
    except ValueError:
        raise OSDPError(f"${name} must be a number, got {text!r}") from None
    if not value >= 0:
        raise OSDPError(f"${name} must be >= 0, got {text!r}")
    return value


def default_max_age_s() -> float:
    return _env_number("OSDP_PROFILE_MAX_AGE_S", DEFAULT_MAX_AGE_S)


# ---- keys ---------------------------------------------------------------------------------

def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def processor_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{_cpu_model()} x{os.cpu_count()}"


def machine_key(device, dtype, backend: str) -> str:
    """``host=..|proc=..|torch=..|dtype=..|backend=..``: the prefix of every key."""
    return (f"host={socket.gethostname()}|proc={processor_name(device)}|torch={torch.__version__}"
            f"|dtype={dtype}|backend={backend}")


# ---- noise --------------------------------------------------------------------------------

def timed_samples(fn: Callable[[], object], repeats: int, timer: Callable[[], float] = time.perf_counter,
                  sync: Callable[[], None] = lambda: None, before: Callable[[], None] = lambda: None) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn`` after one warm-up call (not counted);
    ``before`` runs untimed ahead of each (a barrier), ``sync`` inside the timing."""
    samples = []
    for rep in range(repeats + 1):
        before()
        sync()
        start = timer()
        fn()
        sync()
        elapsed = timer() - start
        if rep:
            samples.append(elapsed)
    return samples


def spread(samples) -> float:
    """(max - min) / median of ``samples``; 0 for fewer than two or a zero median."""
    samples = list(samples)
    if len(samples) < 2:
        return 0.0
    mid = statistics.median(samples)
    return (max(samples) - min(samples)) / mid if mid > 0 else 0.0


@dataclass(frozen=True)
class Steady:
    """What :func:`steady` kept: the samples of the steadiest attempt."""

    samples: tuple[float, ...]
    spread: float
    attempts: int  # measurements made
    noisy: bool
    index: int = 0  # which attempt (0-based) was kept

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


def noise_threshold() -> float:
    return _env_number("OSDP_PROFILE_NOISE", DEFAULT_NOISE_THRESHOLD)


def steady(measure: Callable[[], list[float]], what: str, threshold: float | None = None,
           retries: int = DEFAULT_NOISE_RETRIES, agree: Callable[[float], float] = lambda s: s) -> Steady:
    """Run ``measure`` (a list of repeats) until its spread is at most ``threshold``,
    re-measuring at most ``retries`` times; the steadiest attempt is kept, and a
    ``NoisyProfileWarning`` names ``what`` when even that one is noisy. ``agree``: the
    spread every rank decides on (the max over ranks: all ranks re-measure together)."""
    threshold = noise_threshold() if threshold is None else float(threshold)
    best = None
    for attempt in range(1, retries + 2):
        samples = tuple(float(s) for s in measure())
        s = agree(spread(samples))
        if best is None or s < best.spread:
            best = Steady(samples, s, attempt, s > threshold, attempt - 1)
        if s <= threshold:
            return Steady(best.samples, best.spread, attempt, False, best.index)
    warnings.warn(
        f"profile: {what} stayed noisy: its {len(best.samples)} repeats spread {best.spread:.0%} "
        f"((max - min) / median) after {retries} re-measures, above the {threshold:.0%} threshold; "
        "used for this plan but not cached (a busy machine? measure again on a quiet one, or raise "
        "$OSDP_PROFILE_NOISE)", NoisyProfileWarning, stacklevel=2,
    )
    return Steady(best.samples, best.spread, retries + 1, True, best.index)


# ---- the machine's speed -------------------------------------------------------------------

def gflops(flops_per_s) -> str:
    """A speed stamp as people read it: '151.7 GFLOP/s' ('no stamp' for None)."""
    return "no stamp" if flops_per_s is None else f"{flops_per_s * 1e-9:.1f} GFLOP/s"


def speed_tolerance() -> float:
    return _env_number("OSDP_PROFILE_SPEED_TOLERANCE", DEFAULT_SPEED_TOLERANCE)


def speeds_agree(a: float, b: float, tolerance: float | None = None) -> bool:
    """Whether two rates are within ``tolerance`` (a fraction) of each other, the larger
    over the smaller."""
    tolerance = speed_tolerance() if tolerance is None else tolerance
    return min(a, b) > 0 and max(a, b) / min(a, b) <= 1.0 + tolerance


@dataclass(frozen=True)
class Speed:
    """What :func:`machine_speed` measured: the reference matmul's rate now."""

    flops_per_s: float
    noisy: bool


def machine_speed(device, repeats: int = 5, timer: Callable[[], float] = time.perf_counter) -> Speed:
    """The rate of a fixed fp32 square matmul on ``device`` now (the median of steady
    repeats): the stamp of [Note: profile cache]'s speed check. Every rank of a profile
    calls it at the same moment, so that the ranks' contention for the machine is in it."""
    device = torch.device(device)
    side = SPEED_MATMUL_SIDE.get(device.type, SPEED_MATMUL_SIDE_DEFAULT)
    gen = torch.Generator(device=device).manual_seed(0)  # its own: the ranks' random streams stay as they were
    a, b = (torch.randn(side, side, generator=gen, device=device) for _ in range(2))
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    with warnings.catch_warnings():  # noise here is reported as Speed.noisy, which the profiler acts on
        warnings.simplefilter("ignore", NoisyProfileWarning)
        kept = steady(lambda: timed_samples(lambda: torch.mm(a, b), repeats, timer=timer, sync=sync),
                      "the reference matmul")
    return Speed(2.0 * side**3 / kept.median, kept.noisy)


def speed_now(device, process_group=None) -> Speed:
    """:func:`machine_speed` on this rank, every rank of ``process_group`` (all call)
    timing it at once: their contention for the machine is part of its speed."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=process_group)
    return machine_speed(device)


def steady_speed(start: Speed, end: Speed, what: str) -> bool:
    """Whether the machine kept one speed from ``start`` to ``end``; if not, warn that
    ``what`` is used but not cached."""
    if not start.noisy and not end.noisy and speeds_agree(start.flops_per_s, end.flops_per_s):
        return True
    how = "stayed noisy" if start.noisy or end.noisy else "changed"
    warnings.warn(f"this machine's speed {how} while {what} (a reference matmul at {gflops(start.flops_per_s)} "
                  f"before, {gflops(end.flops_per_s)} after): used for this plan but not cached (a busy machine? "
                  "measure again on a quiet one)", NoisyProfileWarning, stacklevel=3)
    return False


# ---- the cache ----------------------------------------------------------------------------

class ProfileCache:
    """Entries by section and key, with their age; see [Note: profile cache]."""

    def __init__(self, path: Path | None, max_age_s: float | None = None, reprofile: bool = False,
                 now: Callable[[], float] = time.time, speed: float | None = None):
        self.path = path  # None: nothing read or written
        self.max_age_s = default_max_age_s() if max_age_s is None else float(max_age_s)
        self.reprofile = reprofile_requested(reprofile)
        self.now = now
        # the machine's speed (machine_speed's FLOP/s) reads are judged by and writes
        # stamped with; None: no speed check
        self.speed = speed
        self.speed_tolerance = speed_tolerance()
        self.stale_speeds: list[float | None] = []  # the stamps of entries passed over as measured at another speed
        self.sections: dict[str, dict] = {name: {} for name in SECTIONS}
        self.dirty = False
        if path is not None:
            self._load()

    @classmethod
    def open(cls, directory=None, *, enabled: bool = True, reprofile: bool = False,
             max_age_s: float | None = None, now: Callable[[], float] = time.time,
             speed: float | None = None) -> "ProfileCache":
        """The cache under ``directory`` (see :func:`cache_dir`); ``enabled=False``: a
        cache that reads and writes nothing. ``speed``: the machine's speed now
        (:func:`machine_speed`), for the speed check."""
        return cls(cache_path(directory) if enabled else None, max_age_s, reprofile, now, speed)

    def _load(self) -> None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return
        except OSError as exc:
            self._corrupt(f"cannot be read ({exc})")
            return
        try:
            data = json.loads(text)
        except ValueError:
            self._corrupt("is not JSON")
            return
        if not isinstance(data, dict):
            self._corrupt("is not a JSON object")
            return
        if data.get("version") != CACHE_VERSION:
            self._corrupt(f"has version {data.get('version')!r}, this osdp writes {CACHE_VERSION}")
            return
        for name in SECTIONS:
            section = data.get(name, {})
            if not isinstance(section, dict):
                self._corrupt(f"has a malformed {name!r} section")
                self.sections = {n: {} for n in SECTIONS}
                return
            for key, entry in section.items():
                if (isinstance(entry, dict) and "value" in entry and isinstance(entry.get("saved_s"), (int, float))
                        and isinstance(entry.get("speed", 0.0), (int, float))):
                    self.sections[name][key] = entry
                else:
                    self.dirty = True  # a malformed entry is dropped at the next save

    def _corrupt(self, why: str) -> None:
        warnings.warn(f"profile cache {self.path} {why}: ignored, measuring again; it is rewritten at the next "
                      "save", ProfileCacheWarning, stacklevel=4)
        self.dirty = True

    def _fresh(self, entry: dict) -> bool:
        return self.now() - float(entry["saved_s"]) <= self.max_age_s

    def get(self, section: str, key: str):
        """The stored value, or None when missing, expired, measured at another speed
        than now or bypassed (reprofile)."""
        if self.reprofile or self.path is None:
            return None
        entry = self.sections[section].get(key)
        if entry is None:
            return None
        if not self._fresh(entry):
            del self.sections[section][key]
            self.dirty = True
            return None
        stamp = entry.get("speed")
        if self.speed is not None and (stamp is None or not speeds_agree(self.speed, stamp, self.speed_tolerance)):
            self.stale_speeds.append(stamp)  # kept: a later run at its speed may read it
            return None
        return entry["value"]

    def put(self, section: str, key: str, value) -> None:
        """Store ``value``, stamped with the time and the cache's ``speed``."""
        entry = {"value": value, "saved_s": float(self.now())}
        if self.speed is not None:
            entry["speed"] = float(self.speed)
        self.sections[section][key] = entry
        self.dirty = True

    def save(self) -> None:
        """Write atomically (expired entries dropped); nothing when unchanged or disabled."""
        if self.path is None or not self.dirty:
            return
        data = {"version": CACHE_VERSION}
        for name in SECTIONS:
            data[name] = {k: e for k, e in sorted(self.sections[name].items()) if self._fresh(e)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.path)  # atomic: readers see the old file or the new one
        self.dirty = False

"""Byte sizes: read them from what users type, write them in a unit that fits.

[Note: sizes need a unit]
A memory size given as text must carry a unit: ``--memory 8`` is refused instead of
being read as 8 bytes. Accepted units (case-insensitive): B; KB, MB, GB, TB (powers of
1000); KiB, MiB, GiB, TiB (powers of 1024). In the Python API a number (int or float,
not a bool) is a count of bytes. Every message and table that prints a size goes
through ``format_bytes``, which picks the unit by the size (so a 1 KiB limit reads
"1.00 KiB", not "0.00 GiB").
"""
from __future__ import annotations

import math
import numbers
import re

from .errors import OSDPError

DECIMAL_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
BINARY_UNITS = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
UNITS = {**DECIMAL_UNITS, **BINARY_UNITS}
ACCEPTED_UNITS = "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"

_SIZE = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?)\s*([a-z]*)", re.IGNORECASE)
# unit -> bytes, largest first: what format_bytes picks from
_FORMAT_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def parse_bytes(value, name: str = "") -> float:
    """Bytes from '8GiB', '16GB', '512 MiB' (a unit is required in text) or from a
    number of bytes (int or float; a bool is refused). ``name`` (e.g. ``--memory`` or
    ``memory_limit``) starts every error message."""
    where = f"{name}: " if name else ""
    if isinstance(value, bool):
        raise OSDPError(f"{where}memory size must be a number of bytes or a string with a unit like "
                        f"'8GiB', got {value!r} (a bool)")
    if isinstance(value, numbers.Real):
        size = float(value)
        shown = repr(value)
    elif isinstance(value, str):
        match = _SIZE.fullmatch(value.strip())
        if not match:
            raise OSDPError(f"{where}cannot read memory size {value!r}; write a number and a unit like 8GiB, "
                            f"16GB or 512MiB (units: {ACCEPTED_UNITS})")
        number, unit = match.group(1), match.group(2).lower()
        if not unit:
            shown_number = number if float(number) > 0 else "8"  # "0GiB" would be refused next
            raise OSDPError(f"{where}memory size {value!r} has no unit; write it like {shown_number}GiB or "
                            f"{shown_number}MiB (units: {ACCEPTED_UNITS})")
        if unit not in UNITS:
            raise OSDPError(f"{where}cannot read memory size {value!r}: unknown unit {match.group(2)!r} "
                            f"(units: {ACCEPTED_UNITS})")
        size = float(number) * UNITS[unit]
        shown = repr(value)
    else:
        raise OSDPError(f"{where}memory size must be a number of bytes or a string with a unit like "
                        f"'8GiB', got {value!r} (a {type(value).__name__})")
    if not math.isfinite(size):
        raise OSDPError(f"{where}memory size must be finite, got {shown}")
    if size < 1:
        raise OSDPError(f"{where}memory size must be at least 1 byte, got {shown}")
    return size


def format_bytes(size: float) -> str:
    """'512 B', '1.50 KiB', '96.00 MiB', '8.00 GiB', '2.00 TiB': the largest binary unit
    that leaves at least 1 (TiB for anything larger)."""
    size = float(size)
    if not math.isfinite(size):
        return f"{size} B"
    for unit, scale in _FORMAT_UNITS:
        if abs(size) >= scale:
            value = size / scale
            return f"{value:.2f} {unit}" if abs(value) < 1e6 else f"{value:.3g} {unit}"
    return f"{size:.0f} B" if size == int(size) else f"{size:.2f} B"


def byte_unit(size: float) -> tuple[str, float]:
    """(unit name, bytes per unit) that ``format_bytes`` would use for ``size``: for
    axes and columns that print many sizes in one unit."""
    for unit, scale in _FORMAT_UNITS:
        if abs(size) >= scale:
            return unit, float(scale)
    return "B", 1.0

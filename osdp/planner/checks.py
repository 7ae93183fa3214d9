"""Checks of values read from users (JSON files, API arguments): each returns the value
when it is right and raises an OSDPError that names the field and says what it takes.

Shared by the hardware profile (``cluster.py``), the run (``run.py``) and what the cost
model reads (``device.py``); a caller that reads a file prefixes the file's name.
"""
from __future__ import annotations

import json
import math
import numbers

from ..errors import OSDPError, a_type


def check_number(value, name: str, *, positive: bool, integer: bool = False, unit: str = ""):
    """``value`` if it is a finite number (an int when ``integer``; never a bool) that is
    > 0 (``positive``) or >= 0; else OSDPError naming ``name``."""
    kind = "an integer" if integer else "a number"
    bound = ("> 0" if positive else ">= 0") + (f" ({unit})" if unit else "")
    is_type = isinstance(value, numbers.Integral if integer else numbers.Real) and not isinstance(value, bool)
    if not is_type:
        raise OSDPError(f"{name} must be {kind} {bound}, got {value!r} ({a_type(value)})")
    if not math.isfinite(value) or (value <= 0 if positive else value < 0):
        raise OSDPError(f"{name} must be {kind} {bound}, got {value!r}")
    return value


def check_mapping(value, name: str) -> dict:
    if not isinstance(value, dict):
        raise OSDPError(f"{name} must be an object, got {value!r} ({a_type(value)})")
    return value


def check_object(value, name: str, required: tuple, optional: tuple = ()) -> dict:
    """A JSON object with the ``required`` keys and maybe the ``optional`` ones."""
    keys = ", ".join(f'"{k}": ...' for k in required)
    if not isinstance(value, dict):
        raise OSDPError(f"{name} must be an object {{{keys}}}, got {value!r} ({a_type(value)})")
    missing = [k for k in required if k not in value]
    unknown = sorted(set(value) - set(required) - set(optional))
    if missing or unknown:
        what = "; ".join(filter(None, (missing and f"lacks {missing}", unknown and f"has unknown keys {unknown}")))
        raise OSDPError(f"{name} {what}; it takes {list(required) + list(optional)}")
    return value


def check_string(value, name: str) -> str:
    if not isinstance(value, str):
        raise OSDPError(f"{name} must be a string, got {value!r} ({a_type(value)})")
    return value


def read_json_file(path, what: str):
    """The JSON in ``path`` (a ``Path``); one-line OSDPErrors naming ``what`` ("plan
    file", "cluster file") and the file for text that is not JSON or a file that
    cannot be read."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise OSDPError(f"{what} {path} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise OSDPError(f"cannot read {what} {path}: {exc}") from None

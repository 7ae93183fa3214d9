"""Checks of ``osdp.OSDP(...)``'s arguments that are not about units or modes: the
device, and the shapes of the containers (``splits``/``modes`` are dicts,
``checkpoint_blocks`` a tuple or list). A plan given as a path is loaded by
``osdp.planner.plan.plan_from_arg`` (the runtime does not import the planner).

Each check raises OSDPError saying what was given and what would be right, before
anything touches the model.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import OSDPError, a_type


def device_arg(device) -> torch.device:
    """``device`` as a torch.device, refused when it is not a device or names CUDA on a
    machine without it (or a GPU index that does not exist)."""
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise OSDPError(f"device must be a torch.device or a string like 'cpu' or 'cuda:0', got {device!r} "
                        f"({a_type(device)})")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise OSDPError(f"device={device!r} is not a device name PyTorch knows; use 'cpu', 'cuda' or "
                        "'cuda:<index>'") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            why = "this PyTorch is built without CUDA" if torch.version.cuda is None else "no GPU is visible"
            raise OSDPError(f"device={device!r} but CUDA is not available ({why}): pass device='cpu', or leave "
                            "device unset to use the GPU when there is one")
        count = torch.cuda.device_count()
        if resolved.index is not None and resolved.index >= count:
            raise OSDPError(f"device={device!r} but this machine has {count} GPU(s) (cuda:0..cuda:{count - 1})")
    return resolved


def mapping_arg(value, name: str, example: str) -> dict:
    """``value`` (None or a dict) as a dict; anything else is refused with an example."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise OSDPError(f"{name} must be a dict {example}, got {value!r} ({a_type(value)})")
    return dict(value)


def names_arg(value, name: str) -> tuple[str, ...]:
    """A tuple or list (or other non-string iterable) of module paths; a single string
    is refused (it would be read one character at a time)."""
    if value is None:
        return ()
    if isinstance(value, str):
        raise OSDPError(f"{name} must be a tuple or list of module paths, got the string {value!r}: "
                        f"pass ({value!r},) for one block")
    if isinstance(value, Mapping) or not hasattr(value, "__iter__"):
        raise OSDPError(f"{name} must be a tuple or list of module paths, got {value!r} ({a_type(value)})")
    names = tuple(value)
    for item in names:
        if not isinstance(item, str):
            raise OSDPError(f"{name} must list module paths (strings), got {item!r} ({a_type(item)}) in {value!r}")
    return names

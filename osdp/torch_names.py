"""Torch APIs whose names moved: the current name where this torch has it, the older one
otherwise. Imported by the runtime and the planner's profiler alike (no layering
between them), so that no osdp call hits a deprecated name (a FutureWarning printed once
per process).

torch >= 2.13 names the flat collectives ``all_gather_single`` / ``reduce_scatter_single``
and deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor``.
"""
from __future__ import annotations

import torch.distributed as dist

# one flat tensor in, one flat tensor out
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

"""Deprecated name: this module moved to :mod:`osdp.profiler.hardware` (the hardware micro-benchmark left the pure planner). Importing it still works
(it is that module, so patching either name patches the same object), with a
DeprecationWarning."""
import sys
import warnings

from ..profiler import hardware as _moved

warnings.warn("osdp.planner.profiler moved to osdp.profiler.hardware", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved

"""Deprecated name: this module moved to :mod:`osdp.profiler.plans` (measuring plans on the runtime). Importing it still works
(it is that module, so patching either name patches the same object), with a
DeprecationWarning."""
import sys
import warnings

from . import plans as _moved

warnings.warn("osdp.profiler.runtime moved to osdp.profiler.plans", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved

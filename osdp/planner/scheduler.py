"""Deprecated name: this module moved to :mod:`osdp.planner.batch_sweep` (the batch-size sweep). Importing it still works
(it is that module, so patching either name patches the same object), with a
DeprecationWarning."""
import sys
import warnings

from . import batch_sweep as _moved

warnings.warn("osdp.planner.scheduler moved to osdp.planner.batch_sweep", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved

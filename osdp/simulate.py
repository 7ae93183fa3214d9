"""Deprecated name: this module moved to :mod:`osdp.cli.simulate` (only the CLI uses it). Importing it still works
(it is that module, so patching either name patches the same object), with a
DeprecationWarning."""
import sys
import warnings

from .cli import simulate as _moved

warnings.warn("osdp.simulate moved to osdp.cli.simulate", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved

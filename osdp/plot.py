"""Deprecated name: this module moved to :mod:`osdp.cli.plot` (only the CLI uses it). Importing it still works
(it is that module, so patching either name patches the same object), with a
DeprecationWarning."""
import sys
import warnings

from .cli import plot as _moved

warnings.warn("osdp.plot moved to osdp.cli.plot", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved

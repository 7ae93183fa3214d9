"""Deprecated name: this module moved to :mod:`osdp.cli.demo` (only the CLI uses it). Importing it still works
(it is that module, so patching either name patches the same object), with a
DeprecationWarning."""
import sys
import warnings

from .cli import demo as _moved

warnings.warn("osdp.demo moved to osdp.cli.demo", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved

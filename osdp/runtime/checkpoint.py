"""Deprecated name: this module moved to :mod:`osdp.runtime.activation_checkpoint` (activation checkpointing; osdp.checkpoint is DCP/HF checkpoints). Importing it still works
(it is that module, so patching either name patches the same object), with a
DeprecationWarning."""
import sys
import warnings

from . import activation_checkpoint as _moved

warnings.warn("osdp.runtime.checkpoint moved to osdp.runtime.activation_checkpoint", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved

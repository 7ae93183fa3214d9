"""Split operators: the extension point for new ways of cutting an operator into slices.

A split op replaces one module by a module whose parameters are cut into ``g`` slices;
each slice is its own shard unit with its own mode. Registering a split op is one new
file that subclasses :class:`SplitModule` and decorates it with
:func:`register_split_op` (see ``split_linear.py``, ``split_embedding.py``).
"""
from . import registry as _registry
from .registry import SplitModule, register_split_op, split_sizes

# importing the built-in ops registers them
from . import split_embedding as _split_embedding  # noqa: F401,E402
from . import split_linear as _split_linear  # noqa: F401,E402

# [Note: lazily registered ops]
# Hugging Face's Conv1D lives in `transformers`, which osdp does not import (it is an
# optional dependency and costs seconds to import). Its split op is registered as soon
# as it can be needed: here if transformers is already loaded, otherwise on the first
# lookup after it was (a model holding a Conv1D has necessarily imported it).
import sys as _sys  # noqa: E402


def _register_lazy_ops() -> None:
    if "transformers.pytorch_utils" in _sys.modules and "osdp.ops.split_conv1d" not in _sys.modules:
        from . import split_conv1d  # noqa: F401


def get_split_op(module, name: str = ""):
    _register_lazy_ops()
    return _registry.get_split_op(module, name)


def registered_split_ops():
    _register_lazy_ops()
    return _registry.registered_split_ops()


get_split_op.__doc__ = _registry.get_split_op.__doc__
registered_split_ops.__doc__ = _registry.registered_split_ops.__doc__
_register_lazy_ops()

__all__ = ["SplitModule", "get_split_op", "register_split_op", "registered_split_ops", "split_sizes"]

"""Split operators: the extension point for new ways of cutting an operator into slices.

A split op replaces one module by a module whose parameters are cut into ``g`` slices;
each slice is its own shard unit with its own mode. Registering a split op is one new
file that subclasses :class:`SplitModule` and decorates it with
:func:`register_split_op` (see ``split_linear.py``, ``split_embedding.py``).
"""
from .registry import SplitModule, get_split_op, register_split_op, registered_split_ops, split_sizes

# importing the built-in ops registers them
from . import split_embedding as _split_embedding  # noqa: F401,E402
from . import split_linear as _split_linear  # noqa: F401,E402

__all__ = ["SplitModule", "get_split_op", "register_split_op", "registered_split_ops", "split_sizes"]

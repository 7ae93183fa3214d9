"""Split operators: the extension point for new ways of cutting an operator into slices.

A split op replaces one module by a module whose parameters are cut into ``g`` slices;
each slice is its own shard unit with its own mode. Registering a split op is one new
file that subclasses :class:`SplitModule` (or :class:`MatmulSplit` for a matmul) and
decorates it with :func:`register_split_op`; see [Note: split op declaration] in
``registry.py`` and ``split_linear_out.py`` (a whole op in a dozen lines).
"""
from . import registry as _registry
from .registry import (
    SplitModule,
    default_split_op,
    default_split_op_for_kind,
    register_split_op,
    split_sizes,
    unregister_split_op,
)

# importing the built-in ops registers them
from . import split_embedding as _split_embedding  # noqa: F401,E402
from . import split_linear as _split_linear  # noqa: F401,E402
from . import split_linear_out as _split_linear_out  # noqa: F401,E402
from .matmul_split import MatmulSplit  # noqa: E402
from .head_cross_entropy import split_head_cross_entropy  # noqa: E402
from .split_experts import experts_op, is_experts_type  # noqa: E402  (transformers' classes: on first lookup)

# [Note: lazily registered ops]
# Hugging Face's Conv1D lives in `transformers`, which osdp does not import (it is an
# optional dependency and costs seconds to import). Its split op is registered as soon
# as it can be needed: here if transformers is already loaded, otherwise on the first
# lookup after it was (a model holding a Conv1D has necessarily imported it).
import sys as _sys  # noqa: E402


def _register_experts_op(module) -> None:
    """A ``transformers`` experts class gets its split op on its first lookup (one op per
    class; [Note: experts split] in split_experts.py)."""
    if "transformers" in _sys.modules and default_split_op(module) is None and is_experts_type(type(module)):
        experts_op(type(module))


def _register_lazy_ops() -> None:
    if "transformers.pytorch_utils" in _sys.modules and "osdp.ops.split_conv1d" not in _sys.modules:
        from . import split_conv1d  # noqa: F401  -- inside: needs the optional transformers package


def get_split_op(module, name: str = "", op_name: str | None = None):
    _register_lazy_ops()
    _register_experts_op(module)
    return _registry.get_split_op(module, name, op_name)


def registered_split_ops():
    _register_lazy_ops()
    return _registry.registered_split_ops()


get_split_op.__doc__ = _registry.get_split_op.__doc__
registered_split_ops.__doc__ = _registry.registered_split_ops.__doc__
_register_lazy_ops()

def split_op_of(module):
    """The default split op for ``module`` (None: it does not split), lazy ops included."""
    _register_lazy_ops()
    return default_split_op(module)


__all__ = [
    "MatmulSplit", "SplitModule", "default_split_op_for_kind", "get_split_op", "register_split_op",
    "registered_split_ops", "split_head_cross_entropy", "split_op_of", "split_sizes", "unregister_split_op",
]

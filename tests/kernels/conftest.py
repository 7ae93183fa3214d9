"""Kernel tests run the Triton kernels in the interpreter on CPU when no GPU is present.

[Note: scoped TRITON_INTERPRET] triton decides compile-vs-interpret when a function is
decorated: its own `tl` helpers at `import triton`, ours at `import osdp_kernels`, and
some lazily imported triton modules later, which assert the same mode. So the mode is
pinned for this whole process with the `triton.knobs` setter, while the environment
variable itself is put back afterwards: worker processes that other test folders spawn
inherit os.environ and must keep the normal CPU path (torch references). Note that in
this process osdp_kernels stays in interpreter mode, so other in-process users of it on
CPU tensors get the (slower, equally correct) interpreter. With a GPU the compiled
kernels are tested instead and nothing is changed.
"""
import os
import sys

import torch

if not torch.cuda.is_available():
    _prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        if "triton" in sys.modules and not sys.modules["triton"].knobs.runtime.interpret:
            raise RuntimeError("triton was imported before tests/kernels/conftest.py set TRITON_INTERPRET=1; "
                               "run the kernel tests in their own pytest process: pytest tests/kernels")
        import triton

        triton.knobs.runtime.interpret = True  # pins the mode in-process (see Note)
        if "osdp_kernels" in sys.modules and not sys.modules["osdp_kernels"].INTERPRET:
            # Imported earlier in this process without the interpreter: load a fresh copy
            # (references held elsewhere keep the old one).
            for name in [m for m in sys.modules if m == "osdp_kernels" or m.startswith("osdp_kernels.")]:
                del sys.modules[name]
        import osdp_kernels  # noqa: F401  (decorates the kernels in interpreter mode)
    finally:
        if _prev is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = _prev

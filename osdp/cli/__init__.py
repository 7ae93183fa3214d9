"""The ``osdp`` command line (``osdp plan | simulate | demo | ...``; ``python -m osdp.cli``).
The parser and commands are in :mod:`osdp.cli.main`; ``simulate``, ``scale``, ``plot`` and
``demo`` are the modules only the CLI uses."""
from .main import build_parser, main

__all__ = ["build_parser", "main"]

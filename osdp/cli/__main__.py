"""``python -m osdp.cli``."""
import sys

from .main import main

sys.exit(main())

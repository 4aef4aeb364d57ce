"""``python -m check_gpu [options]`` (with ``tools/`` on ``PYTHONPATH``): the same as
``python -m aioep check-gpu``."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())

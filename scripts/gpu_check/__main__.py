"""``python -m gpu_check``: the one-GPU acceptance check (``check.py``)."""

from .check import main

main()

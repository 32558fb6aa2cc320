"""The GPU acceptance checks of HexiSeq (run by ``scripts/gpu_check.sh`` and
``scripts/gpu_check_multi.sh``, with ``scripts/`` on ``PYTHONPATH``; docs/gpu.md).

``python -m gpu_check`` (``check.py``) is the one-GPU check: every part compares the runtime on this
device with an independent reference, and ``--self-test`` proves each part fails on broken
attention (``breaks.py``). ``python -m gpu_check.multi`` (``multi.py``) is the 2+ GPU check under
torchrun. Simulated ranks (``sim.py``) run the real runtime under ``tests/nccl_sim.py``; the packed
path's CPU stand-in is ``tests/varlen_standin.py``. Acceptance code, not a benchmark: performance
figures live in ``bench/``.
"""

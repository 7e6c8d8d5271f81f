"""Attention kernels: Triton on CUDA, PyTorch on CPU.

OpenMP's busy-wait policy must be set before torch is imported: on a 2-core
machine an actively spinning OpenMP pool fights every other process and decode
fell from 14 to 1.8 tok/s when anything else ran.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

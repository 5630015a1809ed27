"""Test-session setup shared by tests/, property_tests/ and benchmarks/.

Without a GPU the Triton kernels run through the Triton interpreter, which must be switched on
before any kernel is defined.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

"""Test-session set-up shared by every test module."""
import os

import torch

# Without a GPU the Triton kernels run in Triton's CPU interpreter (numpy
# emulation). The variable must be set before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

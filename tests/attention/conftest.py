"""Triton kernels are tested under the interpreter (CPU tensors): TRITON_INTERPRET must be set before the
first ``import triton`` of the process, so it is set here, when this folder is collected."""

from __future__ import annotations

import os
import sys

if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

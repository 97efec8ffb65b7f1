"""The plugin tests' fixtures (fake distributions, a clean plugin state) serve the kit's tests too. The emulated
CUDA and ROCm checks run Triton's interpreter, which must be chosen before the process first imports triton
(the CPU plugin's check, collected first, compiles graphs and imports it): so it is set when this folder is
collected, as tests/attention does, and the folder runs alone as well as in the whole suite."""

from __future__ import annotations

import os
import sys

from tests.plugins.conftest import FakeSite, clean_plugin_state, fake_site  # noqa: F401

if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

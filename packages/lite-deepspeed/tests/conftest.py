"""Fixtures for lite-deepspeed's tests (run them with `hatch run test-deepspeed:all`).

The subprocess fixtures (`run_script`, `output_of`) come from the repository's `conftest.py`.
DeepSpeed runs on its CPU accelerator here; its JIT-compiled ops are never built.
"""

from __future__ import annotations

import os

os.environ["DS_ACCELERATOR"] = "cpu"

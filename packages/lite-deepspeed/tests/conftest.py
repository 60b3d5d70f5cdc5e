"""Fixtures for lite-deepspeed's tests (run them with `hatch run test-deepspeed:all`).

The subprocess helpers are the repository's integration fixtures (`tests/conftest.py`).
DeepSpeed runs on its CPU accelerator here; its JIT-compiled ops are never built.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

os.environ["DS_ACCELERATOR"] = "cpu"

_INTEGRATION = Path(__file__).resolve().parents[3] / "tests" / "conftest.py"
_spec = importlib.util.spec_from_file_location("_lite_integration_fixtures", _INTEGRATION)
assert _spec is not None and _spec.loader is not None
integration = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(integration)

run_script = integration.run_script
output_of = integration.output_of

"""Run every test environment of the workspace (`hatch run <env>:all`) and summarise the cells.

Test environments are the hatch environments whose name is `test` or starts with `test-`.
`python tools/test_suite.py` runs them all; `python tools/test_suite.py test-cuda` runs one.
Exits non-zero if any cell failed (a cell that collects no test fails too: pytest exits 5).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time


def test_environments() -> list[str]:
    """Names of the test environments hatch knows, in the order hatch.toml declares them."""
    shown = subprocess.run(["hatch", "env", "show", "--json"], check=True, capture_output=True, text=True)
    return [name for name in json.loads(shown.stdout) if name == "test" or name.startswith("test-")]


def run_cell(env: str) -> tuple[int, float]:
    """Run one environment's `all` script; returns its exit code and duration in seconds."""
    print(f"\n===== {env} =====", flush=True)
    started = time.monotonic()
    code = subprocess.run(["hatch", "run", f"{env}:all"]).returncode
    return code, time.monotonic() - started


def main(argv: list[str]) -> int:
    envs = argv or test_environments()
    results = {env: run_cell(env) for env in envs}
    print("\n| cell | result | seconds |\n| --- | --- | ---: |")
    for env, (code, seconds) in results.items():
        print(f"| {env} | {'passed' if code == 0 else f'FAILED (exit {code})'} | {seconds:.0f} |")
    return 0 if all(code == 0 for code, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The backend pages say what the code ships: the strategy table of `docs/backends/cpu.md` (one
Markdown table: a blank line ends it) names every strategy that lite-core registers."""

from __future__ import annotations

import itertools
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def strategies_in_table(page: Path) -> set[str]:
    """The names in the first column of the table whose header starts with `| strategy |`."""
    lines = page.read_text(encoding="utf-8").splitlines()
    header = next(index for index, line in enumerate(lines) if line.startswith("| strategy |"))
    rows = itertools.takewhile(lambda line: line.startswith("|"), lines[header + 2:])
    return {name for row in rows for name in re.findall(r"`([^`]+)`", row.split("|")[1])}


def test_the_cpu_page_tables_every_strategy_lite_core_registers():
    pyproject = tomllib.loads((ROOT / "packages/lite-core/pyproject.toml").read_text(encoding="utf-8"))
    registered = set(pyproject["project"]["entry-points"]["lite_core.strategies"])
    assert registered - strategies_in_table(ROOT / "docs/backends/cpu.md") == set()

"""Sums the per-test CPU-seconds that `LITE_TEST_CPU_LOG=<folder>` recorded (root conftest.py), per
module, largest first: `python tools/cpu_report.py <folder> [--tests N]`."""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path


def read(folder: Path) -> list[tuple[str, float, float]]:
    """Every recorded test as (node id, CPU-seconds, wall seconds), the CPU-seconds of the programs
    the fork server forked for it (its `forked-*.tsv` rows) added to the test's."""
    rows: dict[str, list[float]] = {}
    forked: dict[str, float] = defaultdict(float)
    for log in sorted(folder.glob("*.tsv")):
        for line in log.read_text().splitlines():
            nodeid, cpu, wall = line.split("\t")
            if log.name.startswith("forked-"):
                forked[nodeid] += float(cpu)
            else:
                entry = rows.setdefault(nodeid, [0.0, 0.0])
                entry[0] += float(cpu)
                entry[1] += float(wall)
    for nodeid, cpu in forked.items():
        rows.setdefault(nodeid, [0.0, 0.0])[0] += cpu
    return [(nodeid, cpu, wall) for nodeid, (cpu, wall) in rows.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--tests", type=int, default=0, help="also list the N most expensive tests")
    args = parser.parse_args()
    rows = read(args.folder)
    modules: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for nodeid, cpu, wall in rows:
        entry = modules[nodeid.split("::", 1)[0]]
        entry[0] += cpu
        entry[1] += wall
        entry[2] += 1
    print(f"total: {sum(r[1] for r in rows):.0f} CPU-s, {sum(r[2] for r in rows):.0f} wall-s, {len(rows)} tests")
    print("| module | CPU-s | wall-s | tests |")
    for module, (cpu, wall, count) in sorted(modules.items(), key=lambda kv: -kv[1][0]):
        print(f"| {module} | {cpu:.0f} | {wall:.0f} | {count} |")
    for nodeid, cpu, wall in sorted(rows, key=lambda r: -r[1])[: args.tests]:
        print(f"{cpu:7.1f} {wall:7.1f} {nodeid}")


if __name__ == "__main__":
    main()

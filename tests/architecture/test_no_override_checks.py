"""No code routes on whether a class overrides a method (`type(x).m is Base.m`): strategies and
precisions declare what their methods change in class attributes (`Strategy.changes_backward`,
`Precision.changes_optimizer_step`, ...; docs/backends/writing.md), so that a subclass that
overrides a method only to log keeps the routing its base declares.

The scan reads every package's source as Python syntax: a comparison with `is` or `is not` whose
left side is an attribute of a `type(...)` call. The second test proves it finds one planted.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("lite-core", "lite-cuda", "lite-xla", "lite-deepspeed", "lite-torchft")


def override_checks(source: str, filename: str) -> list[str]:
    """`filename:line` of each `type(...).X is ...` / `is not ...` comparison in `source`."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Compare) or not any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            continue
        left = node.left
        if (isinstance(left, ast.Attribute) and isinstance(left.value, ast.Call)
                and isinstance(left.value.func, ast.Name) and left.value.func.id == "type"):
            found.append(f"{filename}:{node.lineno}")
    return found


def scan(roots: list[Path]) -> list[str]:
    """Every override check in the `.py` files under `roots`."""
    return [hit for root in roots for path in sorted(root.rglob("*.py"))
            for hit in override_checks(path.read_text(), str(path.relative_to(ROOT)))]


def test_no_code_asks_whether_a_method_is_overridden() -> None:
    hits = scan([ROOT / "packages" / name / "src" for name in PACKAGES])
    assert not hits, (
        "routing on `type(x).method is Base.method` changes silently when a subclass overrides the method"
        f" only to log: declare a class attribute instead (docs/backends/writing.md): {hits}")


def test_the_scan_finds_a_planted_override_check() -> None:
    planted = (
        "def plain(strategy):\n"
        "    return type(strategy).backward is Strategy.backward\n"
        "def own(precision):\n"
        "    return x if type(precision).optimizer_step is not Precision.optimizer_step else y\n"
        "def fine(obj):\n"
        "    return type(obj) is Strategy and obj.name is not None\n"
    )
    assert override_checks(planted, "planted.py") == ["planted.py:2", "planted.py:4"]

"""`progress_bar` on one process: drawn on a terminal, plain lines elsewhere, a clear error without tqdm.

Rank 1 staying silent is tested with two real processes in tests/integration/test_logging.py.
"""

from __future__ import annotations

import importlib.util
import io
import sys

import pytest

from lite_core import LightningLite, progress_bar
from lite_core.errors import MissingDependencyError


#: The bar itself needs the optional tqdm; the `test` environment has it, backend ones need not.
needs_tqdm = pytest.mark.skipif(
    importlib.util.find_spec("tqdm") is None,
    reason="needs tqdm (lite-core[progress]), not installed in this environment (run it in `test`)",
)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@needs_tqdm
def test_bar_is_drawn_on_a_terminal() -> None:
    out = Terminal()
    assert list(progress_bar(range(4), LightningLite(accelerator="cpu"), file=out, desc="train")) == [0, 1, 2, 3]
    assert "train" in out.getvalue() and "4/4" in out.getvalue()


def _counts(text: str) -> list[str]:
    """The `n/total` (or `nit`) of each plain line."""
    return [line.split(" [")[0].split()[-1] for line in text.splitlines()]


@needs_tqdm
def test_off_a_terminal_it_prints_a_plain_line_every_twentieth_of_the_total() -> None:
    out = io.StringIO()
    bar = progress_bar(range(40), file=out, desc="train")
    for i in bar:
        if i == 5:
            bar.set_postfix(loss=0.25)
    assert _counts(out.getvalue()) == [f"{n}/40" for n in range(0, 41, 2)]
    assert all(line.startswith("train: ") for line in out.getvalue().splitlines())
    assert "loss=0.25" in out.getvalue().splitlines()[-1]
    assert "\r" not in out.getvalue()


@needs_tqdm
def test_off_a_terminal_manual_updates_print_when_they_pass_a_line_and_at_close() -> None:
    out = io.StringIO()
    with progress_bar(total=100, file=out, miniters=10) as bar:
        for _ in range(7):
            bar.update(3)  # 3, 6, ..., 21: lines where a multiple of 10 is passed, and the end
    assert _counts(out.getvalue()) == ["0/100", "12/100", "21/100"]


@needs_tqdm
def test_off_a_terminal_without_a_total_every_hundred_and_where_the_loop_stopped() -> None:
    out = io.StringIO()
    for i in progress_bar(iter(range(1000)), file=out):
        if i == 250:
            break
    assert _counts(out.getvalue()) == ["0it", "100it", "200it", "250it"]


def test_missing_tqdm_names_the_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'tqdm>=4\.60'`\.$"):
        progress_bar(range(3))

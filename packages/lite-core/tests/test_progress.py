"""`progress_bar` on one process: shown on a terminal, silent elsewhere, a clear error without tqdm.

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


@needs_tqdm
def test_bar_is_silent_when_output_is_not_a_terminal() -> None:
    out = io.StringIO()
    bar = progress_bar(range(3), file=out, desc="train")
    assert list(bar) == [0, 1, 2]
    bar.set_postfix(loss=1.0)
    bar.close()
    assert out.getvalue() == ""


@needs_tqdm
def test_manual_updates_work_while_silent() -> None:
    out = io.StringIO()
    with progress_bar(total=10, file=out) as bar:
        bar.update(5)
    assert out.getvalue() == ""


def test_missing_tqdm_names_the_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'lite-core\[progress\]'`\.$"):
        progress_bar(range(3))

"""The "did you mean ...?" guess of a misspelt precision, strategy or accelerator, as a user meets it:
the sentence `LightningLite(...)` refuses the name with."""

from __future__ import annotations

import pytest

from lite_core import LightningLite
from lite_core._suggest import closest
from lite_core.errors import ConfigurationError


@pytest.mark.parametrize(("kwargs", "guess"), [
    ({"precision": "bf16-mix"}, "bf16-mixed"),  # a prefix of the name, not the same-length '16-mixed'
    ({"precision": "bf16-mixd"}, "bf16-mixed"),
    ({"precision": "16-mix"}, "16-mixed"),
    ({"precision": "bf16-tru"}, "bf16-true"),
    ({"precision": "64true"}, "64-true"),
    ({"strategy": "ddp-spawn"}, "ddp_spawn"),
    ({"strategy": "ddp_frok"}, "ddp_fork"),
    ({"strategy": "fdsp"}, "fsdp"),
    ({"strategy": "modelparallel"}, "model_parallel"),
    ({"accelerator": "cpux"}, "cpu"),
])
def test_a_misspelt_name_is_guessed_by_the_fewest_edits(kwargs: dict[str, str], guess: str) -> None:
    with pytest.raises(ConfigurationError, match=rf"did you mean '{guess}'\?"):
        LightningLite(**kwargs)


@pytest.mark.parametrize(("name", "candidates", "guess"), [
    ("bf16-mix", ["16-mixed", "bf16-mixed", "16-true"], "bf16-mixed"),  # 2 letters short beats 4 edits
    ("cdua", ["cpu", "cuda"], "cuda"),  # two neighbours swapped is one edit
    ("dpp", ["dp", "ddp"], "ddp"),  # equally few edits: the same length wins
    ("fp8", ["16-mixed", "32-true"], None),
])
def test_the_fewest_edits_win(name: str, candidates: list[str], guess: str | None) -> None:
    assert closest(name, candidates) == guess

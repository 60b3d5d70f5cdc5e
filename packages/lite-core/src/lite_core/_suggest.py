"""The "did you mean ...?" guess for a misspelt name."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

#: Matches this close to the best one count as equally likely typos.
_TIE = 0.15


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate `name` most likely misspells, or None when none is close.

    Among near-equal matches the one of the same length wins: a swapped or wrong letter is a
    likelier typo than a whole letter too many, so "dpp" means "ddp" rather than "dp".
    """
    choices = sorted(set(candidates))
    matches = difflib.get_close_matches(name, choices, n=max(1, len(choices)))
    scored = [(difflib.SequenceMatcher(None, name, c).ratio(), c) for c in matches]
    if not scored:
        return None
    best = scored[0][0]
    near = [(abs(len(c) - len(name)), -ratio, c) for ratio, c in scored if ratio >= best - _TIE]
    return min(near)[2]

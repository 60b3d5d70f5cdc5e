"""The "did you mean ...?" guess for a misspelt name."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

#: A candidate this similar (difflib's ratio) counts as close whatever its edit distance.
_CLOSE_RATIO = 0.6


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate `name` most likely misspells, or None when none is close (at most a third of
    `name`'s letters away, or similar enough by difflib's ratio).

    The fewest typing edits win (a letter added, dropped, replaced, or two neighbours swapped),
    so "bf16-mix" means "bf16-mixed" (two letters short) rather than "16-mixed" (four edits).
    Among equally few edits the candidate of the same length wins: a swapped or wrong letter is
    a likelier typo than a letter too many, so "dpp" means "ddp" rather than "dp".
    """
    scored = []
    for candidate in sorted(set(candidates)):
        edits = _edits(name, candidate)
        ratio = difflib.SequenceMatcher(None, name, candidate).ratio()
        if edits <= len(name) // 3 or ratio >= _CLOSE_RATIO:
            scored.append((edits, abs(len(candidate) - len(name)), -ratio, candidate))
    return min(scored)[3] if scored else None


def _edits(a: str, b: str) -> int:
    """The fewest insertions, deletions, substitutions and swaps of neighbouring letters that
    turn `a` into `b` (the optimal string alignment distance)."""
    before: list[int] = []
    previous = list(range(len(b) + 1))
    for i, letter in enumerate(a, start=1):
        current = [i]
        for j, other in enumerate(b, start=1):
            cost = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (letter != other))
            if i > 1 and j > 1 and letter == b[j - 2] and a[i - 2] == other:
                cost = min(cost, before[j - 2] + 1)
            current.append(cost)
        before, previous = previous, current
    return previous[-1]

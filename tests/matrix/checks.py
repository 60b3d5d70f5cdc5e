"""Running the scenario under a cell, and comparing its numbers with the reference."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import torch

from cells import Cell

SCENARIO = Path(__file__).resolve().parent / "scenario.py"


def run_scenario(run_script: Callable[..., Any], output_of: Callable[..., str], cell: Cell, out_dir: Path,
                 *args: Any, script: Path = SCENARIO) -> dict[str, Any]:
    """Run the scenario (or another matrix script) under `cell`'s constructor arguments; rank 0's result.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {"DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), **cell.env()}
    mutant = os.environ.get("LITE_MUTANT")  # tests/mutants: a planted fault in every process of the run
    if mutant:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [mutant, os.environ.get("PYTHONPATH")]))
    proc = run_script(script, out_dir, *args, env=env, timeout=cell.timeout)
    assert proc.returncode == 0, output_of(proc)
    return json.loads((out_dir / "result.json").read_text())


def assert_close(actual: Any, expected: Any, tolerance: float, what: str) -> None:
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), atol=tolerance, rtol=0, msg=lambda m: f"{what}: {m}")


def assert_weights_close(actual: dict[str, list[float]], expected: dict[str, list[float]], tolerance: float) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        assert_close(actual[name], expected[name], tolerance, f"weight {name}")


def assert_ran_as(cell: Cell, result: dict[str, Any]) -> None:
    """The run reported, from inside, the strategy class, accelerator, precision, world size and
    way of starting processes that the cell asks for, and its first layer computed in the dtype
    of that precision (bf16 under bf16 autocast or bf16 weights, ...)."""
    from importlib.metadata import entry_points

    registered = {ep.name: ep.value for ep in entry_points(group="lite_core.strategies")}
    assert result["strategy"] == cell.ran_as, result["strategy"]
    assert result["strategy_class"] == registered[cell.ran_as], result["strategy_class"]
    assert result["accelerator"] == cell.accelerator
    assert (result["world_size"], result["precision"]) == (cell.devices, cell.precision)
    assert result["processes"] == [cell.launched_as] * cell.devices, result["processes"]
    from reference import DTYPES

    assert result["computed_in"] == [str(DTYPES[cell.precision])], result["computed_in"]  # the precision applied

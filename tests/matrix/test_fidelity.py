"""The set-up model is the user's model under every strategy: `fidelity.py`'s observations of it,
each compared with the same code on the plain model in one process.

One run of `fidelity.py` per cell (a process start each) observes every behaviour; the tests
below compare one behaviour each, so a failure names it. A few behaviours differ by design, each
named in `DESIGNED` with the reason (docs/set-up-model.md). Run one cell alone with `-k`, e.g.
`hatch run test:matrix -k "fidelity and fsdp-2-32-true"`; DeepSpeed's cells run in `test-deepspeed`.
"""

from __future__ import annotations

from functools import cache
from typing import Any, Callable

import pytest

from cells import BY_ID, Cell, skip_reason
from checks import SCENARIO, run_scenario

#: Two ranks average their gradients where one process takes the whole batch's mean: the same
#: numbers summed in another order (measured: under 2e-7 here).
AVERAGED = 1e-6

STRATEGIES = ["single_device-1-32-true", "ddp-2-32-true", "ddp_spawn-2-32-true", "fsdp-2-32-true",
              "model_parallel-2-32-true", "deepspeed_stage_2-2-32-true", "deepspeed_stage_3-2-32-true"]
BEHAVIOURS = ["is_the_user_object", "named_parameters", "named_buffers", "named_modules", "named_children", "modules",
              "children", "apply", "get_parameter", "get_submodule", "get_buffer", "submodule_named_module",
              "isinstance", "state_dict_keys", "hooks", "losses", "trained", "full_state_dict", "attribute", "buffer",
              "buffer_in_state_dict", "submodule", "new_parameter", "deepcopy", "double",
              "optimizer_built_before_setup_module"]

_DISTRIBUTED = ("ddp", "ddp_spawn", "fsdp", "model_parallel", "deepspeed_stage_2", "deepspeed_stage_3")
_REFUSED = "refused: MisuseError"
#: behaviour -> {strategy: (what it gives instead of plain PyTorch's result, why)}
DESIGNED: dict[str, dict[str, tuple[Any, str]]] = {
    "new_parameter": {name: (_REFUSED, "the strategy would neither synchronise nor shard a parameter added after"
                                       " setup: refused in one sentence") for name in _DISTRIBUTED},
    "double": {name: (_REFUSED, "DDP's buckets and FSDP's all-gather buffers keep the dtype of setup: the"
                                " conversion is refused before it happens") for name in _DISTRIBUTED},
    "deepcopy": {name: ("refused: AssertionError", "torch's fully_shard refuses to copy a sharded module (use"
                                                  " lite.full_state_dict(model) for a plain copy)")
                 for name in ("fsdp", "model_parallel")},
}
_ENGINE = ("DeepSpeed builds its engine from the model and the optimizer together: setup_optimizers() after"
           " setup_module() is refused; call setup(model, optimizer)")
#: strategy -> {behaviour: why DeepSpeed's engine cannot} (pytest.mark.xfail, strict)
XFAIL: dict[str, dict[str, str]] = {
    "deepspeed_stage_2": {"optimizer_built_before_setup_module": _ENGINE},
    "deepspeed_stage_3": {
        "optimizer_built_before_setup_module": _ENGINE,
        "get_parameter": "ZeRO-3 partitions each parameter in place: outside a forward pass its shape is 0"
                         " (DeepSpeed keeps the full one in ds_shape)",
        "deepcopy": "ZeRO-3's partitioned parameters cannot be deep-copied",
    },
}


def _param(cell_id: str, behaviour: str) -> Any:
    cell = BY_ID[cell_id]
    marks = [pytest.mark.timeout(cell.timeout + 30)]
    if cell.devices > 1:
        marks.append(pytest.mark.multiprocess)
    # The set-up model's behaviour is Lite's own: the everywhere cells' observations (a job each)
    # run in `test` only, not again beside every backend.
    reason = skip_reason(cell, everywhere=False)
    if reason:
        marks.append(pytest.mark.skip(reason=reason))
    xfail = XFAIL.get(cell.strategy, {}).get(behaviour)
    if xfail:
        marks.append(pytest.mark.xfail(reason=xfail, strict=True))
    return pytest.param(cell, behaviour, marks=marks, id=f"{cell_id}-{behaviour}")


@cache
def _plain() -> dict[str, Any]:
    import fidelity

    return {"is_the_user_object": True, **fidelity.plain()}


@pytest.fixture(scope="module")
def observed_under(run_script: Callable[..., Any], output_of: Callable[..., str],
                   tmp_path_factory: pytest.TempPathFactory) -> Callable[[Cell], dict[str, Any]]:
    """`observed_under(cell)` -> the observations of the cell's one run."""
    done: dict[str, dict[str, Any]] = {}

    def get(cell: Cell) -> dict[str, Any]:
        if cell.id not in done:
            out_dir = tmp_path_factory.mktemp(f"fidelity-{cell.id}")
            done[cell.id] = run_scenario(run_script, output_of, cell, out_dir,
                                         script=SCENARIO.with_name("fidelity.py"))["observed"]
        return done[cell.id]

    return get


def same(actual: Any, expected: Any, tolerance: float) -> bool:
    """Equal, floats within `tolerance` (in nested lists and dicts)."""
    if isinstance(expected, float) and isinstance(actual, (int, float)):
        return abs(actual - expected) <= tolerance
    if isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple)):
        return len(actual) == len(expected) and all(same(a, e, tolerance) for a, e in zip(actual, expected))
    if isinstance(expected, dict) and isinstance(actual, dict):
        return actual.keys() == expected.keys() and all(same(actual[k], expected[k], tolerance) for k in expected)
    return actual == expected


@pytest.mark.parametrize(("cell", "behaviour"), [_param(c, b) for c in STRATEGIES for b in BEHAVIOURS])
def test_the_set_up_model_behaves_as_the_plain_model(cell: Cell, behaviour: str, observed_under: Any) -> None:
    actual = observed_under(cell)[behaviour]
    expected = _plain()[behaviour]
    designed = DESIGNED.get(behaviour, {}).get(cell.strategy)
    if designed is not None:
        expected, why = designed
        assert actual == expected, f"{behaviour} under {cell.strategy}: {actual!r}, designed {expected!r} ({why})"
        return
    assert same(actual, expected, AVERAGED), f"{behaviour} under {cell.strategy}: {actual!r}, plain: {expected!r}"

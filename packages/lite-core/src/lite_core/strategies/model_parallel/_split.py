"""Cutting a model into pipeline stages at module names, keeping the unsplit model's names.

The model's *units* are its children, expanded wherever a split point lies inside one: a split at
`"blocks.2"` makes `blocks`'s children units, and `blocks.2` the first unit of a stage. Each stage's
part is a structural copy of the model (every module on the way to a unit copied, the units
themselves shared) without the other stages' units, as torchtitan's `module_fqns_per_model_part`
does: so a part's `state_dict()` keys are those of the unsplit model, and its `forward` is the
model's own. Inside `nn.Sequential`, `nn.ModuleList` and `nn.ModuleDict` a missing unit is
left out (their iteration skips it, their keys stay); a missing container is an empty one;
elsewhere a missing unit is an `_absent.Absent` stand-in that hands its input on (and is false,
for `if self.embed:`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

from torch import nn

from lite_core.errors import MisuseError
from lite_core.strategies.model_parallel._absent import Absent

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def split_names(model: nn.Module, split_points: Sequence[str | int] | None) -> list[str]:
    """The split points as module names (an index of an `nn.Sequential` becomes its name),
    each checked to name a module of `model`."""
    names = [str(point) for point in split_points or ()]
    modules = dict(model.named_modules())
    for name in names:
        if not name or name not in modules:
            raise MisuseError(
                f"The split point {name!r} names no module of {type(model).__name__}: pass names from"
                " model.named_modules() (such as 'blocks.2'), or indexes of an nn.Sequential."
            )
    return names


def units(model: nn.Module, split_points: list[str]) -> tuple[list[str], set[str]]:
    """(the model's units in order, the modules expanded to reach them)."""
    found: list[str] = []
    expanded: set[str] = {""}

    def walk(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            full = prefix + name
            if any(point.startswith(full + ".") for point in split_points):
                expanded.add(full)
                walk(full + ".", child)
            else:
                found.append(full)

    walk("", model)
    return found, expanded


def assign_stages(model: nn.Module, split_points: list[str], num_stages: int) -> tuple[list[list[str]], set[str]]:
    """The units of each of `num_stages` stages (cut at `split_points`, or evenly without them), and
    the expanded modules; refuses a split that leaves a stage empty or parameters outside every unit."""
    if not split_points:
        split_points, names, expanded = _default_cut(model, num_stages)
    else:
        names, expanded = units(model, split_points)
    _refuse_own_parameters(model, expanded)
    if num_stages > len(names):
        raise MisuseError(
            f"{num_stages} pipeline stages need at least as many layers, but {type(model).__name__} splits into"
            f" {len(names)} ({', '.join(names)}): lower pipeline_parallel_size (or stages per process), or name"
            " split points inside a block (such as 'blocks.2')."
        )
    if not split_points:
        starts = [*_even_starts(len(names), num_stages), len(names)]
        return [names[starts[i]:starts[i + 1]] for i in range(num_stages)], expanded
    if len(split_points) != num_stages - 1:
        raise MisuseError(
            f"{len(split_points)} split points make {len(split_points) + 1} stages, but the pipeline has"
            f" {num_stages} (pipeline_parallel_size x stages per process): pass {num_stages - 1} split points."
        )
    cuts = []
    for point in split_points:
        if point not in names or names.index(point) == 0:
            raise MisuseError(
                f"The split point {point!r} does not begin a stage of its own (split points must be in"
                " forward order, not nested in each other, and not the first layer): name the module that"
                " begins each stage after the first."
            )
        cuts.append(names.index(point))
    if cuts != sorted(set(cuts)):
        raise MisuseError(
            f"The split points {split_points} are not in the order of the model's layers: list them in forward order."
        )
    bounds = [0, *cuts, len(names)]
    return [names[bounds[i]:bounds[i + 1]] for i in range(num_stages)], expanded


def _default_cut(model: nn.Module, num_stages: int) -> tuple[list[str], list[str], set[str]]:
    """(split points, units, expanded modules) without split points from the user: the largest
    `nn.ModuleList`/`nn.Sequential`/`nn.ModuleDict` (most children, then most parameters; a
    transformer's blocks) is cut evenly, what comes before it going to the first stage and what
    comes after it to the last. With fewer children than stages, every unit (the container's
    children among them) is spread evenly and no split points are returned."""
    blocks = _largest_container_children(model)
    names, expanded = units(model, blocks[:1])
    if len(blocks) < num_stages:
        return [], names, expanded
    return [blocks[start] for start in _even_starts(len(blocks), num_stages)[1:]], names, expanded


def _largest_container_children(model: nn.Module) -> list[str]:
    """The names of the children of the model's largest container (see `_default_cut`); `[]`
    without one. A container below a module with parameters of its own is passed over (that module
    would have to be cut open, leaving its parameters to no stage)."""
    best: tuple[int, int] = (0, 0)
    found: list[str] = []
    owners = {name for name, module in model.named_modules() if module._parameters}
    for name, module in model.named_modules():
        if not isinstance(module, _CONTAINERS) or any(_encloses(owner, name) for owner in owners):
            continue
        size = (len(module._modules), sum(p.numel() for p in module.parameters()))
        if size > best:
            best = size
            found = [f"{name}.{child}" if name else child for child in module._modules]
    return found


def _encloses(outer: str, name: str) -> bool:
    """Whether module `outer` is `name` or one of its ancestors (the root `""` encloses everything)."""
    return outer == name or outer == "" or name.startswith(outer + ".")


def _even_starts(count: int, parts: int) -> list[int]:
    """Where each of `parts` nearly equal runs of `count` items begins (the first runs one longer)."""
    base, extra = divmod(count, parts)
    return [part * base + min(part, extra) for part in range(parts)]


def _refuse_own_parameters(model: nn.Module, expanded: set[str]) -> None:
    for name, module in model.named_modules():
        if name in expanded and module._parameters:
            owner = name or type(model).__name__
            raise MisuseError(
                f"Module {owner!r} holds parameters of its own ({', '.join(module._parameters)}) that no pipeline"
                " stage would own: move them into a submodule, so that a stage can hold them."
            )


def part(model: nn.Module, stages: list[list[str]], index: int, expanded: set[str]) -> nn.Module:
    """A structural copy of `model` that holds only stage `index`'s units (shared, not copied);
    the other stages' units are left out, emptied or stand-ins (see the module's docstring)."""
    earlier = {unit for stage in stages[:index] for unit in stage}
    return _copy(model, "", set(stages[index]), expanded, lambda name: name in earlier)


def trim(model: nn.Module, keep: set[str], expanded: set[str]) -> None:
    """Remove, in place, every unit of `model` not named in `keep` (the other stages' layers)."""
    for name, module in list(model.named_modules()):
        if name in expanded:
            for child_name in list(module._modules):
                full = f"{name}.{child_name}" if name else child_name
                if full not in keep and full not in expanded:
                    _drop(module, child_name, full, None)


def _copy(module: nn.Module, prefix: str, keep: set[str], expanded: set[str],
          before: Callable[[str], bool]) -> nn.Module:
    new = copy.copy(module)
    for key, value in module.__dict__.items():  # hook dicts, parameters, buffers: the copy's own
        if isinstance(value, (dict, set)):
            new.__dict__[key] = copy.copy(value)
    for name, child in module._modules.items():
        full = prefix + name
        if full in expanded:
            new._modules[name] = _copy(child, full + ".", keep, expanded, before)
        elif full not in keep and child is not None:
            _drop(new, name, full, before(full))
    return new


def _drop(module: nn.Module, name: str, full: str, before: bool | None) -> None:
    """Leave unit `name` (`full` in the model) out of `module`: a container's entry is removed, a
    child that is a container becomes an empty one (so that the model's `for block in self.blocks`
    runs on every stage), another child a stand-in that hands its input on (`before`: the unit
    belongs to an earlier stage; `None`: to no stage this module runs)."""
    child = module._modules[name]
    if isinstance(module, _CONTAINERS):
        del module._modules[name]
    elif isinstance(child, _CONTAINERS):
        module._modules[name] = _emptied(child)
    else:
        module._modules[name] = Absent(full, before)


def _emptied(container: nn.Module) -> nn.Module:
    """A copy of `container` (its class and attributes) without its layers."""
    new = copy.copy(container)
    for key, value in container.__dict__.items():
        if isinstance(value, (dict, set)):
            new.__dict__[key] = copy.copy(value)
    new._modules.clear()
    new._parameters.clear()
    new._buffers.clear()
    return new


def copies_of(part: nn.Module, model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(copy, the model's module it copies) for each module of `part` that is not shared with
    `model`: their `training` flags are set apart, so the pipeline keeps them in step."""
    originals = dict(model.named_modules())
    return [(module, originals[name]) for name, module in part.named_modules()
            if name in originals and module is not originals[name]]

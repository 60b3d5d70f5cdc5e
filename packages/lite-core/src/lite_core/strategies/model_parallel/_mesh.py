"""`ModelParallelStrategy`'s sizes: the `MeshLayout` given as `mesh=`, or the one its keyword
arguments (`data_parallel_size=`, ...) build, whose messages name those keywords; never both."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from lite_core.errors import ConfigurationError
from lite_core.parallel import MeshLayout

#: The size keywords with their defaults, by the `MeshLayout` field each sets.
KEYWORDS = {"pipeline": ("pipeline_parallel_size", 1), "shard": ("data_parallel_size", "auto"),
            "context": ("context_parallel_size", 1), "tensor": ("tensor_parallel_size", "auto")}


@dataclass(frozen=True)
class _KeywordLayout(MeshLayout):
    """A `MeshLayout` built from the strategy's keywords: its messages name them."""

    _LABELS: ClassVar[dict[str, str]] = {"replicate": "replicate",
                                         **{name: keyword for name, (keyword, _) in KEYWORDS.items()},
                                         "expert": "expert"}


def requested(mesh: Any, sizes: dict[str, Any]) -> MeshLayout:
    """The layout asked for: `mesh`, or the one of `sizes` (keyword values by field); a `mesh`
    beside a size keyword that is not its default is refused in one sentence."""
    if mesh is None:
        return _KeywordLayout(**sizes)
    given = [f"{keyword}={sizes[name]!r}" for name, (keyword, default) in KEYWORDS.items() if sizes[name] != default]
    if given:
        raise ConfigurationError(
            f"mesh= and {', '.join(given)} were both given: pass every size in mesh=MeshLayout(...) and leave out"
            " the size keywords."
        )
    if not isinstance(mesh, MeshLayout):
        raise ConfigurationError(
            f"mesh={mesh!r} is not a MeshLayout: pass mesh=lite_core.parallel.MeshLayout(...) with the sizes."
        )
    return mesh


"""`setup(torch.compile(model, **options))`: the strategy wraps the user's plain module, and the
wrapped module is compiled again with the user's options.

Compiling the wrapper, not the module inside it, is what `torch.compile` expects of DDP (its
graph breaks then fall at the gradient buckets) and FSDP; and the set-up model keeps the plain
module's state dict keys (no `_orig_mod.` prefix), so checkpoints move between compiled and
uncompiled runs.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn


class CompileOptions:
    """How the user compiled their module, to compile another module the same way.

    `torch.compile(model, backend=..., mode=..., options=..., fullgraph=..., dynamic=...)` returns
    an `OptimizedModule` that keeps all of these in its dynamo context (`dynamo_ctx`); applying that
    context to another module compiles it with the same options.
    """

    def __init__(self, dynamo_context: Any) -> None:
        self._context = dynamo_context

    def compile(self, module: nn.Module) -> nn.Module:
        """`module` compiled with the user's options: a new module whose call runs the compiled code."""
        return self._context(module)

    def compile_in_place(self, module: nn.Module) -> None:
        """Compile `module`'s call in place with the user's options, as `nn.Module.compile` does:
        `module(...)` then runs the compiled code and `module` stays the same object (for
        wrappers that hold the module and call it themselves, e.g. DeepSpeed's engine)."""
        module._compiled_call_impl = self._context(module._call_impl)  # what nn.Module.compile sets


def unwrap_compiled(module: nn.Module) -> tuple[nn.Module, CompileOptions | None]:
    """The plain module inside a `torch.compile`d one and the options it was compiled with; any
    other module as it is, with `None`."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled
    if eval_frame is None or not isinstance(module, eval_frame.OptimizedModule):
        return module, None
    return module._orig_mod, CompileOptions(module.dynamo_ctx)

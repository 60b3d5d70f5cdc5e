"""The backends lite-core knows of, for the line that installs one that is missing.

Written by tools/known_backends.py from each backend package's entry points and lite-core's
extras: do not edit; run `python tools/known_backends.py` after changing either.
"""

from __future__ import annotations

#: Backend package -> (the lite-core extra that installs it, the names it registers by kind).
KNOWN_BACKENDS: dict[str, tuple[str, dict[str, tuple[str, ...]]]] = {
    "lite-cuda": ("cuda", {
        "accelerator": (
            "cuda",
            "gpu",
        ),
        "strategy": (
            "dp",
        ),
    }),
    "lite-xla": ("xla", {
        "accelerator": (
            "tpu",
            "xla",
        ),
        "strategy": (
            "single_xla",
            "xla",
            "xla_fsdp",
        ),
    }),
    "lite-deepspeed": ("deepspeed", {
        "strategy": (
            "deepspeed",
            "deepspeed_stage_1",
            "deepspeed_stage_2",
            "deepspeed_stage_2_offload",
            "deepspeed_stage_3",
            "deepspeed_stage_3_offload",
        ),
    }),
    "lite-torchft": ("torchft", {
        "strategy": (
            "ddp_ft",
            "diloco",
            "diloco_fsdp",
            "fsdp_ft",
            "local_sgd",
        ),
    }),
}

"""Mutant: the requested strategy is silently replaced by another (ddp_spawn runs as ddp)."""

import os

_SWAP = {"ddp_spawn": "ddp", "ddp_fork": "ddp", "ddp": "ddp_spawn", "fsdp": "ddp"}
if os.environ.get("LITE_STRATEGY") in _SWAP:
    os.environ["LITE_STRATEGY"] = _SWAP[os.environ["LITE_STRATEGY"]]

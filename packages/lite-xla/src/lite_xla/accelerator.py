"""`accelerator="tpu"` (alias `"xla"`): TPU cores, or any device torch-xla drives through PJRT.

Nothing here imports torch-xla at module level, and nothing touches the XLA runtime: asking a
runtime how many devices it has would start it in the launching process, after which torch-xla
can no longer start the replicas ("Runtime is already initialized"). Availability and device
counts therefore come from the environment and the device files.
"""

from __future__ import annotations

import glob
import os
from importlib.util import find_spec
from typing import Any

import torch

from lite_core.plugins import Accelerator, ConfigurationError, PrecisionSupport

#: What XLA devices run: float32 or bfloat16 weights, bfloat16 autocast; no FP8, no quantized weights.
XLA_PRECISION_SUPPORT = PrecisionSupport(families=frozenset({"true", "mixed"}),
                                         true_dtypes=frozenset({torch.float32, torch.bfloat16}),
                                         mixed_dtypes=frozenset({torch.bfloat16}), hardware=frozenset())


class XLAAccelerator(Accelerator):
    """TPU cores (or the device `PJRT_DEVICE` names); `devices=N` runs N replicas.

    XLA runs on one device or on every device of the host: `devices=1` or `devices=[i]` runs one
    process on one device, `devices=N` (or `"auto"`) starts one replica per device.
    """

    name = "tpu"
    priority = 20
    default_distributed_strategy = "xla"
    default_interactive_strategy = "xla"  # torch-xla starts the replicas itself, script or not
    default_single_device_strategy = "single_xla"
    precision_support = XLA_PRECISION_SUPPORT
    autocast_device_type = "xla"
    #: Replicas communicate through XLA's own collectives, not a `torch.distributed` process group:
    #: the core's process-group strategies (`ddp`, `fsdp`, ...) refuse this device; `xla` and
    #: `xla_fsdp` run on it.
    distributed_backend = None

    @staticmethod
    def is_available() -> bool:
        """torch-xla is installed and a TPU is visible, or `PJRT_DEVICE` names another device."""
        if find_spec("torch_xla") is None:
            return False
        return bool(os.environ.get("PJRT_DEVICE")) or _tpu_chip_count() > 0

    @staticmethod
    def parse_devices(devices: Any) -> list[int]:
        """The device indexes `devices` names, checked against the TPU devices of this host.

        On a TPU host, `devices=N` must be 1 or the host's device count (torch-xla starts one
        replica on every device, whatever N says) and `devices=[i]` must name one of them. On
        XLA's CPU device the count is whatever `devices` asks for (`CPU_NUM_DEVICES`).
        """
        indexes = _parse(devices)
        _check_on_this_host(devices, indexes)
        return indexes

    def get_device(self, index: int) -> torch.device:
        import torch_xla

        return torch_xla.device(index)

    def peak_flops(self, device: torch.device, dtype: str) -> float | None:
        """Dense per-chip peak of this TPU generation (see `lite_xla._peaks`); `None` off TPU."""
        from lite_xla import _peaks

        return _peaks.dense_peak_flops(_peaks.accelerator_type(), dtype)


def device_count() -> int:
    """How many XLA devices this host has, read without starting the runtime (at least 1)."""
    if os.environ.get("PJRT_DEVICE", "TPU").upper() == "CPU":
        return max(1, int(os.environ.get("CPU_NUM_DEVICES", "1")))
    return max(1, _tpu_device_count())


def _parse(devices: Any) -> list[int]:
    if devices == "auto" or devices is None:
        return list(range(device_count()))
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    if isinstance(devices, int) and not isinstance(devices, bool) and devices > 0:
        return list(range(devices))
    if isinstance(devices, (list, tuple)) and len(devices) == 1 and _is_index(devices[0]):
        return [int(devices[0])]
    raise ConfigurationError(
        f"devices={devices!r} is not valid for accelerator='tpu', which runs on one device or on"
        " all of them: pass devices=1, devices=[index] or devices=N (e.g. 8)."
    )


def _check_on_this_host(devices: Any, indexes: list[int]) -> None:
    """Refuse devices a TPU host does not have, or a replica count torch-xla would not start."""
    if os.environ.get("PJRT_DEVICE", "TPU").upper() != "TPU":
        return  # CPU: as many as asked for; other PJRT devices: counted by their own runtime
    count = _tpu_device_count()
    if count == 0 or len(indexes) == count or (len(indexes) == 1 and indexes[0] < count):
        return
    if len(indexes) == 1:
        raise ConfigurationError(
            f"devices={devices!r} names TPU device {indexes[0]} but this host has {count} (0 to"
            f" {count - 1}): pass devices=[index] with an index below {count}."
        )
    raise ConfigurationError(
        f"devices={devices!r} asks for {len(indexes)} TPU devices but this host has {count}, and"
        f" torch-xla runs on one device or on all of them: pass devices={count} (or devices=1)."
    )


#: PCI ids of TPU chips (vendor Google, 0x1ae0); v2 and v3 chips hold two devices (cores) each.
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TWO_CORE_CHIPS = frozenset({"0x0027"})
_ONE_CORE_CHIPS = frozenset({"0x005e", "0x0063", "0x006f", "0x0076", "0x0056", "0x0062"})


def _tpu_device_count(pci_root: str = "/sys/bus/pci/devices") -> int:
    """TPU devices of this host from the PCI ids of its chips (what torch-xla counts), else one
    per accelerator device file."""
    devices = 0
    for vendor in glob.glob(os.path.join(pci_root, "*", "vendor")):
        folder = os.path.dirname(vendor)
        if _read(vendor) != _GOOGLE_PCI_VENDOR:
            continue
        chip = _read(os.path.join(folder, "device"))
        devices += 2 if chip in _TWO_CORE_CHIPS else 1 if chip in _ONE_CORE_CHIPS else 0
    return devices or _tpu_chip_count()


def _read(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return ""


def _tpu_chip_count() -> int:
    return len(glob.glob("/dev/accel*")) or len(glob.glob("/dev/vfio/[0-9]*"))


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0

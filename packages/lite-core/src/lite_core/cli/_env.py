"""`lite env`: the installed core and backends, whether each is compatible, and the hardware they see."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from importlib.metadata import Distribution, distributions
from typing import Any

from packaging.utils import canonicalize_name

_GROUPS = {"accelerators": "lite_core.accelerators", "strategies": "lite_core.strategies"}


def register(commands: Any) -> None:
    """Add the `env` subcommand."""
    parser = commands.add_parser("env", help="describe the installed core, backends, torch and hardware",
                                 description="Print what to paste into a bug report.")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.set_defaults(handler=show, command="env")


def show(args: argparse.Namespace) -> int:
    """Print the report (text or JSON)."""
    report = collect()
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def collect() -> dict[str, Any]:
    """Everything `lite env` reports, as plain data."""
    return {
        "python": f"{platform.python_version()} ({platform.platform()})",
        "torch": _torch(),
        "packages": [_package(dist) for dist in _lite_distributions()],
    }


def _torch() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    if torch.version.cuda:
        build = f"CUDA {torch.version.cuda}"
    elif getattr(torch.version, "hip", None):
        build = f"ROCm {torch.version.hip}"
    else:
        build = "CPU"
    backends = [] if not dist.is_available() else [
        name for name, check in (("gloo", dist.is_gloo_available), ("nccl", dist.is_nccl_available),
                                 ("mpi", dist.is_mpi_available)) if check()
    ]
    return {"version": torch.__version__, "build": build, "cuda_available": torch.cuda.is_available(),
            "cuda_devices": torch.cuda.device_count(), "distributed_backends": backends}


def _lite_distributions() -> list[Distribution]:
    """lite-core first, then every distribution that declares Lite entry points, once each."""
    found: dict[str, Distribution] = {}
    for dist in distributions():
        name = canonicalize_name(dist.metadata["Name"] or "")
        if name in found or not any(ep.group in _GROUPS.values() for ep in dist.entry_points):
            continue
        found[name] = dist
    return sorted(found.values(), key=lambda d: (canonicalize_name(d.metadata["Name"]) != "lite-core",
                                                  canonicalize_name(d.metadata["Name"])))


def _package(dist: Distribution) -> dict[str, Any]:
    from lite_core._compat import check_compatible
    from lite_core.errors import IncompatibleBackendError

    entry = {"name": dist.metadata["Name"], "version": dist.version, "compatible": True, "problem": None,
             "accelerators": [], "strategies": _names(dist, "strategies")}
    try:
        check_compatible(dist)
    except IncompatibleBackendError as err:
        entry.update(compatible=False, problem=str(err))
        return entry  # never import a backend the core refuses
    entry["accelerators"] = [_accelerator(ep) for ep in _entry_points(dist, "accelerators")]
    return entry


def _entry_points(dist: Distribution, kind: str) -> list[Any]:
    return sorted((ep for ep in dist.entry_points if ep.group == _GROUPS[kind]), key=lambda ep: ep.name)


def _names(dist: Distribution, kind: str) -> list[str]:
    return [ep.name for ep in _entry_points(dist, kind)]


def _accelerator(ep: Any) -> dict[str, Any]:
    try:
        accelerator_cls = ep.load()
        available = bool(accelerator_cls.is_available())
        return {"name": ep.name, "available": available, "description": accelerator_cls().describe(),
                "problem": None}
    except Exception as err:
        return {"name": ep.name, "available": False, "description": None,
                "problem": f"failed to import or query ({type(err).__name__}: {err})"}


def render(report: dict[str, Any]) -> str:
    """The report as the text `lite env` prints."""
    torch = report["torch"]
    lines = [
        f"Python        {report['python']}",
        f"torch         {torch['version']} ({torch['build']} build); CUDA available: {torch['cuda_available']},"
        f" {torch['cuda_devices']} device(s); distributed: {', '.join(torch['distributed_backends']) or 'none'}",
        "",
        "Packages:",
    ]
    for package in report["packages"]:
        lines.extend(_render_package(package))
    return "\n".join(lines)


def _render_package(package: dict[str, Any]) -> list[str]:
    status = "compatible" if package["compatible"] else f"INCOMPATIBLE: {package['problem']}"
    lines = [f"  {package['name']} {package['version']}  [{status}]"]
    for accelerator in package["accelerators"]:
        detail = accelerator["problem"] or accelerator["description"]
        state = "available" if accelerator["available"] else "not available"
        lines.append(f"    accelerator {accelerator['name']}: {state} - {detail}")
    if package["strategies"]:
        lines.append(f"    strategies: {', '.join(package['strategies'])}")
    return lines


if __name__ == "__main__":  # pragma: no cover
    sys.exit(show(argparse.Namespace(json=False)))

"""`lite env`: the installed core and backends, whether each is compatible, and the hardware they see."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from importlib.metadata import Distribution, PackageNotFoundError, distributions, version
from typing import Any

from packaging.utils import canonicalize_name

from lite_core._install import install_hint

_GROUPS = {"accelerators": "lite_core.accelerators", "strategies": "lite_core.strategies"}
#: The report's first line, so that whoever runs `lite env` knows what it is for.
OPENING = "Paste this whole report, from this line on, into your bug report."


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
        "numpy": _version("numpy"),
        "memory": _memory(),
        "lite_variables": {name: value for name, value in sorted(os.environ.items()) if name.startswith("LITE_")},
        "model_parallel": _model_parallel(),
        "packages": [_package(dist) for dist in _lite_distributions()],
        "not_installed": _not_installed(),
    }


def _not_installed() -> list[dict[str, Any]]:
    """The backend packages Lite knows of that are not installed, each with the command that
    installs it and the names it would provide."""
    from lite_core._registry import known_backends

    return [{"name": package, "install": install_command(package, extra), "provides": provides}
            for package, (extra, provides) in known_backends().items() if _version(package) is None]


def install_command(package: str, extra: str) -> str:
    """The command that installs the backend `package` today: Lite's packages are not on the
    package index yet, so pip takes the core's `extra` and the backend from the folders of a
    clone of Lite's repository (the README's route; `pip install 'lite-core[EXTRA]'` fails)."""
    return install_hint(extra)


def _version(distribution: str) -> str | None:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def _memory() -> dict[str, float | None]:
    """Total and available RAM in GiB, from /proc/meminfo (Linux), else the total from sysconf."""
    found: dict[str, float | None] = {"total_gib": None, "available_gib": None}
    try:
        with open("/proc/meminfo") as handle:
            fields = dict(line.split(":", 1) for line in handle if ":" in line)
        found["total_gib"] = _gib(int(fields["MemTotal"].split()[0]) * 1024)
        found["available_gib"] = _gib(int(fields["MemAvailable"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        try:
            found["total_gib"] = _gib(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (OSError, ValueError, AttributeError):
            pass
    return found


def _gib(size: int) -> float:
    return round(size / 2**30, 1)


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


def _model_parallel() -> dict[str, Any]:
    """The mesh `ModelParallelStrategy` builds (2-D, and with a pipeline) and the pipeline schedules
    this torch offers."""
    import importlib.util

    from lite_core.strategies.model_parallel import _pipeline
    from lite_core.strategies.model_parallel import MESH_DIM_NAMES, PIPELINE_MESH_DIM_NAMES

    available = importlib.util.find_spec("torch.distributed.pipelining") is not None
    return {"mesh": list(MESH_DIM_NAMES), "pipeline_mesh": list(PIPELINE_MESH_DIM_NAMES),
            "pipeline_schedules": list(_pipeline.SCHEDULE_NAMES) if available else []}


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
             "accelerators": [], "strategies": _names(dist, "strategies"), "strategy_problems": {}}
    try:
        check_compatible(dist)
    except IncompatibleBackendError as err:
        entry.update(compatible=False, problem=str(err))
        return entry  # never import a backend the core refuses
    entry["accelerators"] = [_accelerator(ep) for ep in _entry_points(dist, "accelerators")]
    problems = {ep.name: _strategy_problem(ep) for ep in _entry_points(dist, "strategies")}
    entry["strategy_problems"] = {name: problem for name, problem in problems.items() if problem}
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


def _strategy_problem(ep: Any) -> str | None:
    """Why the strategy registered as `ep` cannot run here (a dependency it declares is missing), or None."""
    try:
        missing = ep.load().missing_requirements()
    except Exception as err:
        return f"failed to import ({type(err).__name__}: {err})"
    return "; ".join(f"needs {module}: {command}" for module, command in missing.items()) or None


def render(report: dict[str, Any]) -> str:
    """The report as the text `lite env` prints."""
    torch = report["torch"]
    memory = report["memory"]
    variables = report["lite_variables"]
    lines = [
        OPENING,
        "",
        f"Python        {report['python']}",
        f"torch         {torch['version']} ({torch['build']} build); CUDA available: {torch['cuda_available']},"
        f" {torch['cuda_devices']} device(s); distributed: {', '.join(torch['distributed_backends']) or 'none'}",
        f"numpy         {report['numpy'] or 'not installed'}",
        f"RAM           {memory['total_gib']} GiB total, {memory['available_gib']} GiB available",
        f"LITE_*        {', '.join(f'{k}={v}' for k, v in variables.items()) or 'none set'}",
        _render_mesh(report["model_parallel"]),
        "",
        "Packages:",
    ]
    for package in report["packages"]:
        lines.extend(_render_package(package))
    if report["not_installed"]:
        lines.extend(["", "Not installed (the backends Lite knows of; install from a clone of Lite's repository):"])
    for package in report["not_installed"]:
        names = "; ".join(f"{kind} {', '.join(listed)}" for kind, listed in package["provides"].items())
        lines.append(f"  {package['name']}: {package['install']}  ({names})")
    return "\n".join(lines)


def _render_mesh(mesh: dict[str, Any]) -> str:
    schedules = ", ".join(mesh["pipeline_schedules"]) or "none (torch.distributed.pipelining is missing)"
    return (f"mesh          model_parallel: ({', '.join(mesh['mesh'])}); with a pipeline:"
            f" ({', '.join(mesh['pipeline_mesh'])}), schedules {schedules}")


def _render_package(package: dict[str, Any]) -> list[str]:
    status = "compatible" if package["compatible"] else f"INCOMPATIBLE: {package['problem']}"
    lines = [f"  {package['name']} {package['version']}  [{status}]"]
    for accelerator in package["accelerators"]:
        detail = accelerator["problem"] or accelerator["description"]
        state = "available" if accelerator["available"] else "not available"
        lines.append(f"    accelerator {accelerator['name']}: {state} - {detail}")
    if package["strategies"]:
        problems = package["strategy_problems"]
        names = [f"{name} ({problems[name]})" if name in problems else name for name in package["strategies"]]
        lines.append(f"    strategies: {', '.join(names)}")
    return lines


if __name__ == "__main__":  # pragma: no cover
    sys.exit(show(argparse.Namespace(json=False)))

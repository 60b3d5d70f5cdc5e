"""`lite run`: torchrun with Lite's choices. The command line is torchrun's own parser
(`torch.distributed.run.get_args_parser`) plus Lite's options and names; the job runs on torch's
elastic agent (`lite_core.launchers.elastic`), every rank through `lite_core.launchers.rank`."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from lite_core.connector._defaults import VARIABLES
from lite_core.errors import ConfigurationError

_DESCRIPTION = """\
Run SCRIPT (or, with -m, a module) on every rank, as torchrun does: this is torchrun underneath
(torch's elastic agent), so every torchrun option below works with torchrun's spelling and
meaning (--nnodes MIN:MAX, --rdzv-backend c10d, --max-restarts, --log-dir, --redirects, --tee,
...). Lite adds --accelerator, --strategy, --precision and --devices, passed to LightningLite
through LITE_ACCELERATOR, LITE_STRATEGY, LITE_PRECISION and LITE_DEVICES (arguments the script
passes to LightningLite(...) in code win over them, with a warning), checks them before any
process starts, and names the rank that failed first.
"""

_EPILOG = """\
Lite's names: --devices (--nproc-per-node, but in LightningLite's terms: 2, '0,1', auto),
--num-nodes (--nnodes), --main-address (--master-addr), --main-port (--master-port).

Several machines (the same command on each; HOST:PORT is one of them):
  lite run --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT train.py
Elastic, with restarts:
  lite run --nnodes 1:4 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint HOST:PORT train.py

Fault-tolerant replica groups (lite-core[torchft], strategy ddp_ft or fsdp_ft): a torchft
lighthouse and N groups of this job on this machine, each group its own `lite run`:
  lite run --replica-groups 2 --strategy ddp_ft train.py

Restarts: each rank sees LITE_RESTART_COUNT (0, then 1, 2, ...). A script resumes by loading its
last checkpoint at the top of run(): self.load(path, state, missing_ok=True).
"""

#: Lite's names for torchrun's options: (Lite's flag, torchrun's destination, type).
_ALIASES = (("--num-nodes", "nnodes", str), ("--main-address", "master_addr", str), ("--main-port", "master_port", int))


def register(commands: Any) -> None:
    """Add the `run` subcommand. Its options are parsed in the handler, with torchrun's parser,
    so that `lite --help` need not import torch."""
    parser = commands.add_parser("run", help="launch a script on every rank: torchrun with Lite's choices",
                                 add_help=False, prefix_chars="\0")
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    parser.set_defaults(handler=run, command="run")


def run(args: argparse.Namespace) -> int:
    """The handler of `lite run`."""
    return launch_command_line(args.argv)


def launch_command_line(argv: Sequence[str], name: str = "lite run") -> int:
    """Parse `lite run`'s arguments `argv`, check them, and run the job on torch's elastic agent;
    returns the exit code (Lite's lines start with `name`)."""
    from lite_core.cli._groups import launch_groups, without_flag
    from lite_core.launchers.elastic import launch, quiet_agent

    groups, argv = without_flag(argv)
    if groups is not None:
        return launch_groups(groups, argv, name)
    with quiet_agent():
        options = parse(argv)
        check_target_exists(options)
        config, entrypoint, entry_args = launch_config(options, name)
    return launch(config, entrypoint, entry_args, name=name)


def build_parser() -> argparse.ArgumentParser:
    """torchrun's argument parser with Lite's options and names added."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog, parser.description, parser.epilog = "lite run", _DESCRIPTION, _EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    lite = parser.add_argument_group("Lite's choices (exported to every rank as LITE_*)")
    lite.add_argument("--accelerator", help="e.g. cpu, cuda, tpu, auto")
    lite.add_argument("--strategy", help="e.g. ddp, deepspeed_stage_3, auto")
    lite.add_argument("--precision", help="e.g. 32-true, bf16-mixed, 16-mixed")
    lite.add_argument("--devices", help="devices (processes) per node in LightningLite's terms: 2, '0,1', auto")
    for flag, dest, kind in _ALIASES:
        lite.add_argument(flag, dest=dest, type=kind, default=argparse.SUPPRESS, help=f"the same as --{dest}")
    # Told apart from torchrun's defaults, so that only a count the user gave is exported.
    parser.set_defaults(nproc_per_node=os.environ.get("PET_NPROC_PER_NODE"), nnodes=os.environ.get("PET_NNODES"))
    script = next(action for action in parser._actions if action.dest == "training_script")
    script.nargs, script.metavar = "?", "SCRIPT"  # a missing script gets Lite's own sentence
    script.help = ("the Python script every rank runs (with -m, the module), then its arguments; Lite picks"
                   " each rank's device")
    return parser


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """`lite run`'s options, checked (each bad one refused in one sentence naming the fix)."""
    options = build_parser().parse_args(list(argv))
    _check_script(options)
    options.gave_nodes = options.nnodes is not None
    options.nodes = _nodes(options.nnodes or "1:1")
    options.nnodes = f"{options.nodes[0]}:{options.nodes[1]}"
    _check(options)
    return options


def _check_script(options: argparse.Namespace) -> None:
    if options.training_script is None:
        if options.module:
            raise ConfigurationError(
                "MODULE is missing after -m: name the module to run, e.g. `lite run -m mypkg.train`."
            )
        raise ConfigurationError("SCRIPT is missing: name the Python file to run after the options, e.g."
                                 " `lite run --devices 2 train.py`.")


def check_target_exists(options: argparse.Namespace) -> None:
    """Refuse a script file or module that is not there, before any rank starts (each rank would
    fail with its own traceback through `runpy`); `--no-python` programs are left to the agent."""
    if options.no_python:
        return
    target = options.training_script
    if not options.module:
        if not os.path.isfile(target):
            raise ConfigurationError(f"SCRIPT {target} is not a file: check the path (relative to {os.getcwd()}).")
        return
    if not _module_exists(target):
        raise ConfigurationError(f"MODULE {target} is not found from {os.getcwd()}: check its name, or install its"
                                 " package (e.g. `pip install -e .`) or run from the folder that holds it.")


def _module_exists(name: str) -> bool:
    """Whether `python -m name`, run from this folder, finds the module (its parent packages are
    imported to look, as `python -m` would)."""
    import importlib.util

    sys.path.insert(0, os.getcwd())  # `python -m` puts the current folder first
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
    finally:
        sys.path.remove(os.getcwd())


def _nodes(value: str) -> tuple[int, int]:
    """`--nnodes N` or `MIN:MAX` as (MIN, MAX)."""
    parts = value.split(":")
    if len(parts) > 2 or not all(part.strip().isdigit() for part in parts):
        raise ConfigurationError(f"--nnodes {value} is not a number of nodes: pass N or MIN:MAX, e.g. --nnodes 2"
                                 " or --nnodes 1:4.")
    low, high = int(parts[0]), int(parts[-1])
    if low < 1:
        raise ConfigurationError(f"--nnodes {value} asks for no node: pass at least 1, e.g. --nnodes 1:{max(high, 1)}.")
    if low > high:
        raise ConfigurationError(f"--nnodes {value} has a minimum above its maximum: pass MIN:MAX with MIN <= MAX,"
                                 f" e.g. --nnodes {high}:{low}.")
    return low, high


def _check(options: argparse.Namespace) -> None:
    """Refuse options that cannot work or that contradict each other."""
    if options.max_restarts < 0:
        raise ConfigurationError(f"--max-restarts {options.max_restarts} is negative: pass 0 or more restarts.")
    if options.devices is not None and options.nproc_per_node is not None:
        raise ConfigurationError(f"--devices {options.devices} and --nproc-per-node {options.nproc_per_node} both"
                                 " give the processes per node: pass only one of them.")
    if options.standalone and (options.nodes[1] > 1 or options.master_port is not None):
        raise ConfigurationError(
            "--standalone runs one node on a free port: drop --num-nodes/--nnodes and --main-port/--master-port."
        )
    if options.rdzv_backend == "static" and not 0 <= options.node_rank < options.nodes[1]:
        raise ConfigurationError(
            f"--node-rank {options.node_rank} is outside the {options.nodes[1]} node(s) of the job: pass a rank"
            f" from 0 to {options.nodes[1] - 1}."
        )
    if options.rdzv_backend == "static" and options.nodes[0] != options.nodes[1]:
        raise ConfigurationError(f"--nnodes {options.nnodes} needs a rendezvous that lets nodes come and go: add"
                                 " --rdzv-backend c10d --rdzv-endpoint HOST:PORT (the same on every node).")


def launch_config(options: argparse.Namespace, name: str = "lite run") -> tuple[Any, Any, list[str]]:
    """The agent's `LaunchConfig`, entry point and arguments for checked `options` (torchrun's
    `config_from_args`), with Lite's choices exported to this process's environment, which the
    ranks inherit (Lite's lines start with `name`)."""
    from lite_core.launchers.torchrun import agent_config

    choices = _choices(options)
    options.nproc_per_node = str(_processes_per_node(options, choices))
    os.environ.update({VARIABLES[variable]: str(value) for variable, value in choices.items()})
    return agent_config(options, name)


def _choices(options: argparse.Namespace) -> dict[str, Any]:
    """The options given, else the `LITE_*` variables already exported, as LightningLite reads them."""
    from lite_core.connector._defaults import parse as parse_variable

    low, high = options.nodes
    given = {"accelerator": options.accelerator, "strategy": options.strategy, "precision": options.precision,
             "devices": options.devices, "num_nodes": low if options.gave_nodes and low == high else None}
    choices: dict[str, Any] = {}
    for name, variable in VARIABLES.items():
        value = given[name]
        if value is None and os.environ.get(variable, "").strip():
            value = parse_variable(name, variable, os.environ[variable].strip())
        if value is not None:
            choices[name] = value
    return choices


def _processes_per_node(options: argparse.Namespace, choices: dict[str, Any]) -> int:
    """How many ranks each node starts: torchrun's `--nproc-per-node` (a number, cpu, gpu, auto),
    else the devices as LightningLite would resolve them. Either way the choices are resolved as
    LightningLite would, so that a bad one fails here, before any process starts."""
    from lite_core.connector._connect import connect

    count = None
    if options.nproc_per_node is not None:
        count = _local_world_size(options.nproc_per_node)
        choices["devices"] = count
    with _rendezvous_variables(options):
        plan = connect(choices.get("accelerator", "auto"), choices.get("strategy", "auto"),
                       _devices(str(choices.get("devices", "auto"))), options.nodes[0],
                       choices.get("precision", "32-true"), None)
    return count if count is not None else len(plan.device_indexes)


def _local_world_size(value: str) -> int:
    from torch.distributed.run import determine_local_world_size

    try:
        count = determine_local_world_size(value)
    except ValueError:
        count = None
    if count is None or count < 1:
        raise ConfigurationError(f"--nproc-per-node {value} starts no process: pass a number of processes per node"
                                 " (1 or more), or cpu, gpu or auto.")
    return int(count)


@contextlib.contextmanager
def _rendezvous_variables(options: argparse.Namespace) -> Iterator[None]:
    """Resolving `num_nodes` > 1 checks for the variables a rank will have (the agent sets them there)."""
    if options.nodes[0] == 1:
        yield
        return
    values = {"MASTER_ADDR": options.master_addr, "MASTER_PORT": str(options.master_port or 29500),
              "NODE_RANK": str(options.node_rank)}
    missing = {name: value for name, value in values.items() if name not in os.environ}
    os.environ.update(missing)
    try:
        yield
    finally:
        for name in missing:
            os.environ.pop(name, None)


def _devices(value: str) -> Any:
    return int(value) if value.strip().isdigit() else value


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run(argparse.Namespace(argv=sys.argv[1:])))

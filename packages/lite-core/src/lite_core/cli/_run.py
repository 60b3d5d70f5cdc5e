"""`lite run`: start every local rank of a script, as torchrun does, with Lite's choices exported."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from lite_core._defaults import VARIABLES
from lite_core.errors import ConfigurationError

_DESCRIPTION = """\
Start one process per device on this node, each running `python SCRIPT ARGS` (or
`python -m MODULE ARGS`) with LOCAL_RANK, RANK, NODE_RANK, LOCAL_WORLD_SIZE, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set, and pass the options below to LightningLite through
LITE_ACCELERATOR, LITE_STRATEGY, LITE_DEVICES, LITE_NUM_NODES and LITE_PRECISION.
Arguments that the script passes to LightningLite(...) in code win over these options (with a
warning). If any rank fails, the others are stopped and `lite run` exits with that rank's code, or, with
--max-restarts N, every rank is started again (up to N times) and the last attempt's code counts.
"""

_EPILOG = """torchrun's names work too: --nproc-per-node (--devices), --nnodes (--num-nodes), --node-rank,
--master-addr (--main-address), --master-port (--main-port), --standalone.

Restarts: each rank sees LITE_RESTART_COUNT (0, then 1, 2, ...); on one node every attempt gets a
fresh free port unless --main-port is given. A script resumes by loading its last checkpoint at
the top of run(): self.load(path, state, missing_ok=True).
"""


def register(commands: Any) -> None:
    """Add the `run` subcommand."""
    parser = commands.add_parser("run", help="launch a script on every rank, like torchrun",
                                 description=_DESCRIPTION, epilog=_EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", help="e.g. cpu, cuda, tpu, auto")
    parser.add_argument("--strategy", help="e.g. ddp, deepspeed_stage_3, auto")
    parser.add_argument("--devices", "--nproc-per-node", "--nproc_per_node", dest="devices",
                        help="devices (processes) per node: 2, '0,1', auto")
    parser.add_argument("--num-nodes", "--nnodes", dest="num_nodes", type=int, help="machines in the job (default 1)")
    parser.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=0,
                        help="this machine's rank (default 0)")
    parser.add_argument("--main-address", "--master-addr", "--master_addr", dest="main_address", default="127.0.0.1",
                        help="address of node 0 (default 127.0.0.1)")
    parser.add_argument("--main-port", "--master-port", "--master_port", dest="main_port", type=int,
                        help="port on node 0; default: a free port (one node only)")
    parser.add_argument("--standalone", action="store_true", help="one node on a free port (torchrun's option)")
    parser.add_argument("--precision", help="e.g. 32-true, bf16-mixed, 16-mixed")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="when a rank fails, stop every rank and start them all again, up to N times (default 0)")
    parser.add_argument("--log-dir", metavar="DIR", help="write each rank's output to DIR/rank<RANK>.log")
    parser.add_argument("--tee", action="store_true", help="with --log-dir: also show the output on the terminal")
    parser.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name, as with python -m")
    parser.add_argument("script", metavar="SCRIPT", nargs="?", help="the Python file (or, with -m, module) to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="passed on to SCRIPT")
    parser.set_defaults(handler=run, command="run")


def run(args: argparse.Namespace) -> int:
    """Resolve the choices, start the ranks of this node and supervise them until they end."""
    from lite_core.launchers.supervision import Job

    _check(args)
    choices = _choices(args)
    rendezvous = _rendezvous(args)
    os.environ.update(rendezvous)  # the multi-node check below reads them, like a rank would
    per_node = _processes_per_node(choices)
    command = [sys.executable, *(["-m", args.script] if args.module else [args.script]), *args.script_args]
    env = {**os.environ, **rendezvous, **{VARIABLES[k]: str(v) for k, v in choices.items()}}
    job = Job(command, env, per_node, num_nodes=choices.get("num_nodes", 1), node_rank=args.node_rank,
              max_restarts=args.max_restarts, fresh_port=args.main_port is None, log_dir=args.log_dir, tee=args.tee)
    return job.run()


def _check(args: argparse.Namespace) -> None:
    """Refuse a command line that names no script or combines options that contradict each other."""
    if args.script is None:
        if args.module:
            raise ConfigurationError(
                "MODULE is missing after -m: name the module to run, e.g. `lite run -m mypkg.train`."
            )
        raise ConfigurationError("SCRIPT is missing: name the Python file to run after the options, e.g."
                                 " `lite run --devices 2 train.py`.")
    if args.max_restarts < 0:
        raise ConfigurationError(f"--max-restarts {args.max_restarts} is negative: pass 0 or more restarts.")
    if args.tee and args.log_dir is None:
        raise ConfigurationError("--tee copies the rank logs to the terminal, so it needs --log-dir DIR as well.")
    if args.standalone and ((args.num_nodes or 1) > 1 or args.main_port is not None):
        raise ConfigurationError(
            "--standalone runs one node on a free port: drop --num-nodes/--nnodes and --main-port/--master-port."
        )


def _choices(args: argparse.Namespace) -> dict[str, Any]:
    """The options given, else the `LITE_*` variables already exported, as LightningLite reads them."""
    from lite_core._defaults import parse

    choices: dict[str, Any] = {}
    for name, variable in VARIABLES.items():
        value = getattr(args, name)
        if value is None and os.environ.get(variable, "").strip():
            value = parse(name, variable, os.environ[variable].strip())
        if value is not None:
            choices[name] = value
    return choices


def _rendezvous(args: argparse.Namespace) -> dict[str, str]:
    num_nodes = args.num_nodes or 1
    if not 0 <= args.node_rank < num_nodes:
        raise ConfigurationError(
            f"--node-rank {args.node_rank} is outside the {num_nodes} node(s) of the job: pass a rank"
            f" from 0 to {num_nodes - 1}."
        )
    port = args.main_port
    if port is None:
        if num_nodes > 1:
            raise ConfigurationError(
                "--num-nodes above 1 needs the same --main-port on every node: pass a free port of node 0."
            )
        from lite_core.environments.local import find_free_port

        port = find_free_port()
    return {"MASTER_ADDR": args.main_address, "MASTER_PORT": str(port), "NODE_RANK": str(args.node_rank)}


def _processes_per_node(choices: dict[str, Any]) -> int:
    """Resolve the choices as LightningLite would (so bad ones fail here) and count the devices."""
    from lite_core._connector import connect

    strategy = connect(choices.get("accelerator", "auto"), choices.get("strategy", "auto"),
                       _devices(str(choices.get("devices", "auto"))), choices.get("num_nodes", 1),
                       choices.get("precision", "32-true"), None)
    return len(strategy.device_indexes)


def _devices(value: str) -> Any:
    return int(value) if value.strip().isdigit() else value

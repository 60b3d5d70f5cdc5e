"""torchrun's command line turned into a job on torch's elastic agent, with Lite's defaults.

Both `lite run` (the command line, above this layer, which adds Lite's options and checks) and
the script launcher's `LITE_MAX_RESTARTS` (which hands its job to the agent) start their ranks
through here, so the launcher never calls up into the command line.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any


def agent_config(options: argparse.Namespace, name: str = "lite run") -> tuple[Any, Any, list[str]]:
    """The agent's `LaunchConfig`, entry point and arguments for torchrun's parsed `options`
    (torch's `config_from_args`), after Lite's rendezvous defaults and with every Python rank run
    through `lite_core.launchers.rank`; Lite's lines about the cores start with `name`."""
    from torch.distributed.run import config_from_args

    _rendezvous_defaults(options)
    _run_each_rank_through_lite(options)
    _share_cores(options, name)
    return config_from_args(options)


def launch_torchrun(argv: Sequence[str], name: str) -> int:
    """Run torchrun's command line `argv` on the elastic agent; returns the exit code (Lite's
    lines start with `name`)."""
    from torch.distributed.run import get_args_parser

    from lite_core.launchers.elastic import launch, quiet_agent

    with quiet_agent():
        config, entrypoint, args = agent_config(get_args_parser().parse_args(list(argv)), name)
    return launch(config, entrypoint, args, name=name)


def _share_cores(options: argparse.Namespace, name: str) -> None:
    """Warn when this node's ranks are more than its usable cores, and give each rank the threads
    every Lite launcher gives (see `lite_core.launchers._cores`): torch's `config_from_args` sets
    the same `OMP_NUM_THREADS=1`, but says so only in a log line that Lite keeps off the terminal."""
    from torch.distributed.run import determine_local_world_size

    from lite_core.launchers._cores import THREADS_VARIABLE, oversubscription, rank_threads, say, threads_notice

    try:
        local = determine_local_world_size(str(options.nproc_per_node))
    except ValueError:
        return  # torch's own parsing says what is wrong
    warning = oversubscription(local)
    if warning is not None:
        say(f"warning: {warning}", name)
    threads = rank_threads(local)
    if threads is None:
        return
    os.environ[THREADS_VARIABLE] = str(threads)  # the agent's ranks inherit this process's environment
    notice = threads_notice(local, threads)
    if notice is not None:
        say(notice, name)


def _max_nodes(options: argparse.Namespace) -> int:
    return int(str(options.nnodes).split(":")[-1])


def _rendezvous_defaults(options: argparse.Namespace) -> None:
    """torchrun's defaults: `--standalone`, or one node with no port or endpoint given, meet on
    a free port of this machine (a c10d store on localhost:0); otherwise the static rendezvous
    uses `--master-port` (default 29500). Ranks get 5 s (Lite's grace period) to exit after
    SIGTERM, unless `--shutdown-timeout` says otherwise."""
    from lite_core.launchers.supervision import GRACE_SECONDS

    alone = options.rdzv_backend == "static" and not options.rdzv_endpoint and options.master_port is None
    if options.standalone or (alone and _max_nodes(options) == 1):
        import uuid

        options.rdzv_backend, options.rdzv_endpoint, options.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if options.master_port is None:
        options.master_port = 29500
    if options.shutdown_timeout is None and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in os.environ:
        options.shutdown_timeout = int(GRACE_SECONDS)


def _run_each_rank_through_lite(options: argparse.Namespace) -> None:
    """A Python script or module runs as `python -u -m lite_core.launchers.rank [-m] TARGET ARGS`
    (see that module); `--no-python` and `--run-path` run as torchrun runs them."""
    if options.no_python or options.run_path:
        return
    from lite_core.launchers import rank

    target = rank.arguments(options.training_script, list(options.training_script_args), options.module)
    options.module, options.training_script, options.training_script_args = True, rank.__name__, target

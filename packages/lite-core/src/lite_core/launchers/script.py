"""Starts the other local ranks by running the user's command again, as torchrun would."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Any, Callable

from lite_core.environments.environment import ClusterEnvironment
from lite_core.errors import MisuseError
from lite_core.launchers._cores import (
    THREADS_VARIABLE,
    rank_threads,
    say,
    threads_notice,
    warn_if_oversubscribed,
)
from lite_core.launchers.launcher import Launcher
from lite_core.launchers.supervision import RankProcesses, describe_exit, exit_code, on_interrupt

#: Set to N > 0 to supervise the ranks from the process the user started and restart them all,
#: up to N times, when one fails (as `lite run --max-restarts N` does).
MAX_RESTARTS_VARIABLE = "LITE_MAX_RESTARTS"


class ScriptLauncher(Launcher):
    """This process becomes local rank 0; local ranks 1..N-1 re-run `sys.argv` with `LOCAL_RANK` set.

    A watchdog thread ends the whole job, with the failing rank's exit code, as soon as any rank
    fails; the other ranks die with this process (Linux parent-death signal). Ctrl-C (SIGINT)
    stops the other ranks at once, even while this process waits in a collective.

    With `LITE_MAX_RESTARTS=N` (N > 0) in the environment this process runs no rank itself: it
    hands the job to torch's elastic agent, exactly as `lite run --max-restarts N` does (every
    local rank a child, all restarted when one fails, up to N times), and exits with the last
    attempt's code (the code after `run()` runs only in the ranks).
    """

    needs_function = False

    def __init__(self, environment: ClusterEnvironment, num_processes: int, num_nodes: int,
                 strategy_name: str = "ddp") -> None:
        self._environment = environment
        self._strategy_name = strategy_name
        self._num_processes = num_processes
        self._num_nodes = num_nodes
        self._ranks = RankProcesses()
        self._watchdog: threading.Thread | None = None

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.start()
        try:
            return fn(*args, **kwargs)
        except BaseException:
            self.stop()
            raise

    def start(self) -> None:
        if len(self._ranks) or self._environment.creates_processes_externally:
            return
        command = _script_command(self._strategy_name)
        restarts = _max_restarts()
        if restarts:
            self._supervise(restarts, chosen_port="MASTER_PORT" in os.environ)
        warn_if_oversubscribed(self._num_processes)
        _limit_threads(self._num_processes)
        os.environ["MASTER_ADDR"] = self._environment.main_address
        os.environ["MASTER_PORT"] = str(self._environment.main_port)
        os.environ["NODE_RANK"] = str(self._environment.node_rank())
        os.environ["WORLD_SIZE"] = str(self._num_processes * self._num_nodes)
        for local_rank in range(1, self._num_processes):
            self._ranks.start(local_rank, command, {**os.environ, "LOCAL_RANK": str(local_rank)})
        os.environ["LOCAL_RANK"] = "0"
        self._watchdog = threading.Thread(target=self._watch, name="lite-watchdog", daemon=True)
        self._watchdog.start()
        on_interrupt(self.stop)
        atexit.register(self._wait_for_children)

    def _supervise(self, restarts: int, chosen_port: bool) -> None:
        """Run the job as `lite run --max-restarts restarts` would, then exit with its code."""
        from lite_core.launchers.torchrun import launch_torchrun

        argv = ["--nproc-per-node", str(self._num_processes), "--nnodes", str(self._num_nodes),
                "--max-restarts", str(restarts)]
        if chosen_port or self._num_nodes > 1:  # else, as torchrun does, a free port of this machine
            argv += ["--node-rank", str(self._environment.node_rank()), "--master-addr",
                     self._environment.main_address, "--master-port", str(self._environment.main_port)]
        raise SystemExit(launch_torchrun([*argv, *_script_target()], name="lite"))

    def _watch(self) -> None:
        failure = self._ranks.watch()
        if failure is not None:
            self._fail(*failure)

    def _fail(self, local_rank: int, code: int) -> None:
        # Straight to file descriptor 2: `sys.stderr` is not thread-safe, and the main thread may be
        # printing its own error (its collective lost the failed rank) at this very moment.
        line = f"lite: local rank {local_rank} failed with {describe_exit(code)}; stopping every rank.\n"
        os.write(2, line.encode(errors="replace"))
        self.stop()
        os._exit(exit_code(code))

    def stop(self) -> None:
        """End every other local rank still running (they are not reported as failures)."""
        self._ranks.stop()

    def _wait_for_children(self) -> None:
        self._ranks.wait()
        if self._watchdog is not None:  # let the watchdog see the last exit codes
            self._watchdog.join()


def _limit_threads(local_processes: int) -> None:
    """Give every local rank torch's agent's thread setting (see `lite_core.launchers._cores`):
    the variable for the ranks this process starts, and this process (rank 0) the same count
    now, as torch read the variable when it started."""
    threads = rank_threads(local_processes)
    if threads is None:
        return
    import torch

    os.environ[THREADS_VARIABLE] = str(threads)
    torch.set_num_threads(threads)
    notice = threads_notice(local_processes, threads)
    if notice is not None:
        say(notice)


def _max_restarts() -> int:
    raw = os.environ.get(MAX_RESTARTS_VARIABLE, "").strip()
    if not raw:
        return 0
    if not raw.isdigit():
        raise MisuseError(f"{MAX_RESTARTS_VARIABLE}={raw!r} is not a number of restarts: set it to 0 or more.")
    return int(raw)


def can_rerun_script() -> bool:
    """Whether this process was started from a script or module that can be run again (not a
    REPL, a notebook or code piped to `python -`)."""
    return main_module() is not None or main_script() is not None


def main_module() -> str | None:
    """The module `python -m` ran as `__main__`, if this process was started that way."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        return str(spec.name).removesuffix(".__main__")
    return None


def main_script() -> str | None:
    """The script file this process runs as `__main__`, if there is one on disk."""
    script = getattr(sys.modules["__main__"], "__file__", None)
    return script if script and os.path.isfile(script) else None


def _script_target() -> list[str]:
    """What `lite run` runs to start this script again: `SCRIPT ARGS` or `-m MODULE ARGS`."""
    module = main_module()
    if module is not None:
        return ["-m", module, *sys.argv[1:]]
    return [os.path.abspath(main_script() or sys.argv[0]), *sys.argv[1:]]


def _script_command(strategy_name: str) -> list[str]:
    module = main_module()
    if module is not None:
        return [sys.executable, "-m", module, *sys.argv[1:]]
    script = main_script()
    if script is None:
        raise MisuseError(
            f"strategy={strategy_name!r} starts the other ranks by running your script again, which an"
            " interactive session or notebook cannot do: use strategy='ddp_notebook' there."
        )
    return [sys.executable, os.path.abspath(script), *sys.argv[1:]]

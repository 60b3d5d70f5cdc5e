"""Starts the other local ranks by running the user's command again, as torchrun would."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from lite_core.environments.environment import ClusterEnvironment
from lite_core.errors import MisuseError
from lite_core.launchers._processes import describe_exit, die_with_parent, on_interrupt, stop_processes
from lite_core.launchers.launcher import Launcher

_POLL_SECONDS = 0.1


class ScriptLauncher(Launcher):
    """This process becomes local rank 0; local ranks 1..N-1 re-run `sys.argv` with `LOCAL_RANK` set.

    A watchdog thread ends the whole job, with the failing rank's exit code, as soon as any rank
    fails; the other ranks die with this process (Linux parent-death signal). Ctrl-C (SIGINT)
    stops the other ranks at once, even while this process waits in a collective.
    """

    needs_function = False

    def __init__(self, environment: ClusterEnvironment, num_processes: int, num_nodes: int) -> None:
        self._environment = environment
        self._num_processes = num_processes
        self._num_nodes = num_nodes
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        self._stopped: set[int] = set()  # local ranks this launcher terminated itself

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.start()
        try:
            return fn(*args, **kwargs)
        except BaseException:
            self.stop()
            raise

    def start(self) -> None:
        if self._children or self._environment.creates_processes_externally:
            return
        command = _script_command()
        os.environ["MASTER_ADDR"] = self._environment.main_address
        os.environ["MASTER_PORT"] = str(self._environment.main_port)
        os.environ["NODE_RANK"] = str(self._environment.node_rank())
        os.environ["WORLD_SIZE"] = str(self._num_processes * self._num_nodes)
        for local_rank in range(1, self._num_processes):
            env = {**os.environ, "LOCAL_RANK": str(local_rank)}
            self._children[local_rank] = subprocess.Popen(command, env=env, preexec_fn=die_with_parent)
        os.environ["LOCAL_RANK"] = "0"
        threading.Thread(target=self._watch, name="lite-watchdog", daemon=True).start()
        on_interrupt(self.stop)
        atexit.register(self._wait_for_children)

    def _watch(self) -> None:
        while self._children:
            for local_rank, child in list(self._children.items()):
                code = child.poll()
                if code is None:
                    continue
                if code != 0 and not self._was_stopped(local_rank, code):
                    self._fail(local_rank, code)
                del self._children[local_rank]
            time.sleep(_POLL_SECONDS)

    def _was_stopped(self, local_rank: int, code: int) -> bool:
        # Ended by `_stop_children` (this process failed and reports that itself), not failed.
        return local_rank in self._stopped and code in (-signal.SIGTERM, -signal.SIGKILL)

    def _fail(self, local_rank: int, code: int) -> None:
        # Straight to file descriptor 2: `sys.stderr` is not thread-safe, and the main thread may be
        # printing its own error (its collective lost the failed rank) at this very moment.
        line = f"lite: local rank {local_rank} failed with {describe_exit(code)}; stopping every rank.\n"
        os.write(2, line.encode(errors="replace"))
        self.stop()
        os._exit(code if code > 0 else 128 - code)

    def stop(self) -> None:
        running = {r: c for r, c in list(self._children.items()) if c.poll() is None}
        self._stopped.update(running)
        stop_processes(running.values())

    def _wait_for_children(self) -> None:
        for child in list(self._children.values()):
            child.wait()
        while self._children:  # let the watchdog see the last exit codes
            time.sleep(_POLL_SECONDS)


def _script_command() -> list[str]:
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        module = spec.name.removesuffix(".__main__")
        return [sys.executable, "-m", module, *sys.argv[1:]]
    script = getattr(main, "__file__", None)
    if not script or not os.path.exists(script):
        raise MisuseError(
            "strategy='ddp' starts the other ranks by running your script again, which an"
            " interactive session or notebook cannot do: use strategy='ddp_notebook' there."
        )
    return [sys.executable, os.path.abspath(script), *sys.argv[1:]]

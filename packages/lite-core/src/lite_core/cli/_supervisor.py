"""Starts the local ranks of `lite run` and ends the whole job when one of them fails."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import tempfile
import threading
from types import FrameType

from lite_core.launchers._processes import (
    FAILURE_DIR_VARIABLE,
    describe_exit,
    die_with_parent,
    rank_to_blame,
    stop_processes,
)

_POLL_SECONDS = 0.05


class Job:
    """`per_node` processes running `command`, one per local rank of node `node_rank`.

    `run()` returns 0 when every rank exits with 0; as soon as one fails it stops the others and
    returns that rank's code (128 + N for a rank killed by signal N). SIGTERM, SIGINT or SIGHUP
    sent to `lite run` stop every rank too.
    """

    def __init__(self, command: list[str], env: dict[str, str], per_node: int, num_nodes: int,
                 node_rank: int) -> None:
        self._command = command
        self._env = env
        self._per_node = per_node
        self._num_nodes = num_nodes
        self._node_rank = node_rank
        self._ranks: dict[int, subprocess.Popen[bytes]] = {}
        self._signal: int | None = None
        self._failures = ""

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        folder = tempfile.TemporaryDirectory(prefix="lite-run-failures-")
        self._failures = folder.name
        try:
            self._start()
            return self._supervise()
        finally:
            self._stop()
            folder.cleanup()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _start(self) -> None:
        for local_rank in range(self._per_node):
            env = {
                **self._env,
                "LOCAL_RANK": str(local_rank),
                "RANK": str(self._node_rank * self._per_node + local_rank),
                "LOCAL_WORLD_SIZE": str(self._per_node),
                "WORLD_SIZE": str(self._per_node * self._num_nodes),
                FAILURE_DIR_VARIABLE: self._failures,
            }
            self._ranks[local_rank] = subprocess.Popen(self._command, env=env, preexec_fn=die_with_parent)

    def _supervise(self) -> int:
        # One waiter thread per rank reports its exit the moment it happens, so the rank that
        # failed first is blamed, not one that failed because of it a moment later.
        exits: queue.Queue[tuple[int, int]] = queue.Queue()
        for local_rank, process in self._ranks.items():
            threading.Thread(target=lambda r=local_rank, p=process: exits.put((r, p.wait())), daemon=True).start()
        remaining = len(self._ranks)
        while remaining:
            if self._signal is not None:
                _say(f"received {signal.Signals(self._signal).name}; stopping every rank.")
                return 128 + self._signal
            try:
                local_rank, code = exits.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                continue
            remaining -= 1
            if code != 0:
                _say(self._blame(local_rank, code))
                return code if code > 0 else 128 - code
        return 0

    def _blame(self, local_rank: int, code: int) -> str:
        """The line that names the failing rank: the first to record a failure, if another one."""
        first = rank_to_blame(self._failures, local_rank)
        if first == local_rank:
            return f"local rank {local_rank} failed with {describe_exit(code)}; stopping every rank."
        return (f"local rank {first} failed first (its error is above) and local rank {local_rank} then ended with"
                f" {describe_exit(code)}; stopping every rank.")

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signal = signum

    def _stop(self) -> None:
        stop_processes(self._ranks.values())


def _say(message: str) -> None:
    sys.stderr.write(f"lite run: {message}\n")
    sys.stderr.flush()

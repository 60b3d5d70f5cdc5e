"""`lite run --replica-groups N`: a torchft lighthouse and N replica groups on this machine.

Each group is its own `lite run` (the remaining arguments, on a free port of its own) with
`REPLICA_GROUP_ID`, `NUM_REPLICA_GROUPS` and `TORCHFT_LIGHTHOUSE` set, and every group (a restarted
one too) has the same `LITE_JOB_ID` (yours if set, else a new one), by which the tracker loggers of
whichever group logs find the job's one run. The lighthouse runs in this
process, so it lives as long as the job. A group that exits with an error is started again (it
heals from a peer at its next quorum), up to `LITE_GROUP_RESTARTS` times (3 by default); then it
is given up and the others go on. The job's exit code is 0 when every group finished.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

from lite_core.plugins import find_free_port

#: How often one group may be started again after it failed (`LITE_GROUP_RESTARTS` overrides it).
GROUP_RESTARTS = 3
#: The lighthouse's settings: a dead group is dropped after a second without heartbeats.
HEARTBEAT_TIMEOUT_MS = 1000
JOIN_TIMEOUT_MS = 2000


def run_replica_groups(groups: int, argv: list[str], name: str = "lite run") -> int:
    """Start the lighthouse and `groups` groups running `lite run argv`; returns the exit code."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=JOIN_TIMEOUT_MS,
                                  heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    address = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    restarts = int(os.environ.get("LITE_GROUP_RESTARTS", GROUP_RESTARTS))
    os.environ.setdefault("LITE_JOB_ID", uuid.uuid4().hex)  # lite-core's tracker loggers read it
    try:
        return _supervise(groups, argv, address, restarts, name)
    finally:
        lighthouse.shutdown()


def _supervise(groups: int, argv: list[str], lighthouse: str, restarts: int, name: str) -> int:
    running = {group: _start(group, groups, argv, lighthouse) for group in range(groups)}
    tries, failed = dict.fromkeys(running, 0), []
    try:
        while running:
            time.sleep(0.2)
            for group, proc in list(running.items()):
                code = proc.poll()
                if code is None:
                    continue
                del running[group]
                if code == 0:
                    continue
                if tries[group] < restarts:
                    tries[group] += 1
                    print(f"{name}: replica group {group} exited with {code}; starting it again"
                          f" ({tries[group]}/{restarts}), it heals from a peer", file=sys.stderr, flush=True)
                    running[group] = _start(group, groups, argv, lighthouse)
                else:
                    print(f"{name}: replica group {group} failed {restarts + 1} times (last exit code {code}):"
                          " given up; the other groups go on", file=sys.stderr, flush=True)
                    failed.append(group)
    finally:
        for proc in running.values():
            proc.terminate()
    return 1 if failed else 0


def _start(group: int, groups: int, argv: list[str], lighthouse: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, REPLICA_GROUP_ID=str(group), NUM_REPLICA_GROUPS=str(groups), TORCHFT_LIGHTHOUSE=lighthouse)
    command = [sys.executable, "-m", "lite_core.cli", "run", "--main-port", str(find_free_port()), *argv]
    return subprocess.Popen(command, env=env)

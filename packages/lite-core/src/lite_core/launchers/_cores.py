"""How the processes Lite starts on this machine share its CPU cores: how many it refuses to
start, when it warns, and how many threads each rank computes on.

Every launcher gives its ranks the same thread setting as torch's elastic agent (`lite run`,
torchrun): when a node runs several ranks and the user has not set `OMP_NUM_THREADS`, each rank
computes on one thread. Without it, each of N ranks keeps torch's default (one thread per core),
and N ranks on N cores oversubscribe them several times over.
"""

from __future__ import annotations

import os

from lite_core._user_frame import warn_user
from lite_core.errors import ConfigurationError

#: The variable that sets the threads of a rank's intra-op pool (read when torch starts).
THREADS_VARIABLE = "OMP_NUM_THREADS"
#: The threads of each rank when a node runs several and the user set none (torch's agent's choice).
RANK_THREADS = 1
#: Processes per usable core above which Lite refuses to start them ...
_MOST_PROCESSES_PER_CORE = 4
#: ... unless they are at most this many (a one-core machine still runs a small job).
_ALWAYS_ALLOWED = 8


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity: a container's or `taskset`'s share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def most_processes(cores: int) -> int:
    """The most processes Lite starts on a machine with `cores` usable cores."""
    return max(_MOST_PROCESSES_PER_CORE * cores, _ALWAYS_ALLOWED)


def check_process_count(processes: int, devices: object) -> None:
    """Refuse to start `processes` processes on this machine (for `devices=...`) when they would
    stall it: more than 4 per usable core (8 are always allowed).

    Raises:
        ConfigurationError: Too many processes for this machine's cores.
    """
    cores = usable_cores()
    if processes > most_processes(cores):
        raise ConfigurationError(
            f"devices={devices!r} would start {processes} processes on this machine, which has {cores} usable CPU"
            f" core(s): pass devices={most_processes(cores)} or fewer (at most {_MOST_PROCESSES_PER_CORE} processes"
            " per core), or run on a machine with more cores."
        )


def oversubscription(processes: int) -> str | None:
    """The warning for `processes` processes started on this machine's cores, if there are fewer cores."""
    cores = usable_cores()
    if processes <= cores:
        return None
    return (f"{processes} processes share this machine's {cores} usable CPU core(s), so each computes slower than"
            f" on a core of its own: start at most {cores} (devices={cores}) for the fastest steps.")


def warn_if_oversubscribed(processes: int) -> None:
    """Warn (a `UserWarning` attributed to the user's line that launched) when `processes`
    processes are more than this machine's usable cores."""
    message = oversubscription(processes)
    if message is not None:
        warn_user(message)


def rank_threads(local_processes: int) -> int | None:
    """The threads each of `local_processes` ranks on this machine computes on: `RANK_THREADS`
    when there are several and the user has not set `OMP_NUM_THREADS`, else None (leave it)."""
    if local_processes > 1 and THREADS_VARIABLE not in os.environ:
        return RANK_THREADS
    return None


def threads_notice(local_processes: int, threads: int) -> str | None:
    """One line saying that `local_processes` ranks of `threads` thread(s) each leave cores idle, or None."""
    cores = usable_cores()
    if cores <= local_processes * threads:
        return None
    return (f"each of the {local_processes} ranks on this machine computes on {threads} CPU thread"
            f" ({THREADS_VARIABLE}={threads}, as torchrun sets it), and {cores} cores are usable: export"
            f" {THREADS_VARIABLE}={cores // local_processes} to use them all.")


def say(line: str, name: str = "lite") -> None:
    """Write `name: line` to stderr in one write (ranks may share the stream)."""
    os.write(2, f"{name}: {line}\n".encode(errors="replace"))


"""Runs a job on torch's elastic agent (`torch.distributed.launcher.api.elastic_launch`, what
`torchrun` runs) and adds what Lite says on top: one line naming the rank that failed first, as
soon as it fails, and one per restart. `lite run` and the script launcher's `LITE_MAX_RESTARTS`
both start their ranks here; the agent does the rest (rendezvous, restarts, membership changes,
stopping the ranks, signals).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from lite_core.environ import export_environ, restore_environ
from lite_core.errors import ConfigurationError
from lite_core.launchers.rank import LAUNCHER_PID_VARIABLE, REFUSAL_KEY
from lite_core.launchers.supervision import FAILURE_DIR_VARIABLE, describe_exit, exit_code, rank_to_blame

#: torch's loggers that report what Lite's own lines already say (each failure and restart, the
#: signals sent to the ranks). `LOGLEVEL=INFO` (torch's variable) shows them again.
_AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")

#: torch's switch off the sharing of the c10d rendezvous store with the ranks. Shared (torch's
#: default), the store's address for the ranks is published only in a node's first rendezvous, so
#: a node that joins a running job (started late, or again after its machine was lost) waits for
#: an address of the new round that the running rank 0 never writes, and both sides time out
#: (torch 2.13, `DynamicRendezvousHandler.next_rendezvous`). Unshared, the agent of rank 0
#: publishes a fresh address every round, where the ranks' rank 0 hosts a store of its own.
_STORE_SHARING_OFF = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def launch(config: Any, entrypoint: str, args: list[str], name: str = "lite run") -> int:
    """Run `entrypoint args` on every local rank under torch's elastic agent; returns the exit code.

    Args:
        config: the agent's `torch.distributed.launcher.api.LaunchConfig`.
        entrypoint: the program every rank runs (e.g. `sys.executable`).
        args: its arguments.
        name: how Lite's lines start (`lite run: ...`).

    Returns:
        0 when every rank succeeded; else the code of the rank that failed first (128 + N for a
        rank ended by signal N), or 128 + N when this process received signal N.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    reporter = _Reporter(name, config.logs_specs, config.max_restarts)
    rendezvous = _rendezvous_environment(config)
    with quiet_agent(), _exported(rendezvous), _rank_environment() as folder, _reporting_agent(reporter, folder):
        try:
            elastic_launch(config, entrypoint)(*args)
        except ChildFailedError:
            return reporter.code
        except SignalException as err:
            reporter.say(f"received {signal.Signals(err.sigval).name}; stopping every rank.")
            return 128 + int(err.sigval)
        except Exception as err:
            explained = _rendezvous_failure(err, config)
            if explained is None:
                raise
            raise explained from err
    return 0


def _rendezvous_failure(err: Exception, config: Any) -> ConfigurationError | None:
    """One sentence for a rendezvous that failed (a port in use, an endpoint nobody serves, nodes
    that did not come), or None for any other error."""
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousTimeoutError

    endpoint = config.rdzv_endpoint
    text = f"{err} {err.__cause__ or ''}"
    if isinstance(err, DistNetworkError) and ("EADDRINUSE" in text or "address already in use" in text.lower()):
        host, _, port = endpoint.rpartition(":")
        return ConfigurationError(
            f"MASTER_PORT={port} is already in use on {host}, so this node cannot host the rendezvous there: stop the"
            " process that holds it, pick another free port, or unset MASTER_PORT (and drop --master-port) to let"
            " Lite choose one."
        )
    if isinstance(err, RendezvousTimeoutError):
        return ConfigurationError(
            f"Fewer than {config.min_nodes} node(s) joined the rendezvous at {endpoint} before its timeout: start"
            " every node with the same --rdzv-endpoint and --rdzv-id, lower the minimum of --nnodes, or raise"
            " --rdzv-conf join_timeout=SECONDS."
        )
    if isinstance(err, (RendezvousConnectionError, DistNetworkError)):
        return ConfigurationError(
            f"Nobody answered at the rendezvous endpoint {endpoint} before the rendezvous timeout: start the node"
            " that hosts it (node 0, or the host named in --rdzv-endpoint) or fix the address and port on this one."
        )
    return None


class _Reporter:
    """Lite's lines about an agent's ranks, and the exit code of the last failure."""

    def __init__(self, name: str, logs_specs: Any, max_restarts: int) -> None:
        self._name = name
        self._logs_specs = logs_specs
        self._max_restarts = max_restarts
        self.code = 1

    def say(self, message: str) -> None:
        sys.stderr.write(f"{self._name}: {message}\n")
        sys.stderr.flush()

    def failed(self, failures: dict[int, Any], folder: str, stderrs: dict[int, str]) -> None:
        """Name the rank that failed first among `failures` ({global rank: ProcessFailure})."""
        by_local = {failure.local_rank: failure for failure in failures.values()}
        # The agent stops the other ranks with SIGTERM before it reports: those did not fail.
        failed = [r for r, f in by_local.items() if f.exitcode != -signal.SIGTERM] or list(by_local)
        first, exited = rank_to_blame(folder, failed)
        code = by_local[exited].exitcode
        self.code = exit_code(code)
        refusal = _refusal(by_local.get(first))
        if refusal is not None:  # Lite refused the script's configuration: its sentence says all
            self.say(f"error: {refusal}")
            return
        where = self._log_folder(first, stderrs)
        if first == exited:
            said = f" (its output is in {where})" if where else ""
            self.say(f"local rank {first} failed with {describe_exit(code)}{said}; stopping every rank.")
        else:
            self.say(f"local rank {first} failed first (its error is {f'in {where}' if where else 'above'}) and local"
                     f" rank {exited} then ended with {describe_exit(code)}; stopping every rank.")
        if where and first in by_local:
            self._show_traceback(by_local[first])

    def _show_traceback(self, failure: Any) -> None:
        """The traceback a rank whose output is off the terminal left in torch's error file (`record`)."""
        message = failure.message
        trace = message.get("extraInfo", {}).get("py_callstack") if isinstance(message, dict) else None
        if trace:
            sys.stderr.write(trace if trace.endswith("\n") else f"{trace}\n")
            sys.stderr.flush()

    def _log_folder(self, local_rank: int, stderrs: dict[int, str]) -> str | None:
        """The folder of `local_rank`'s log files when its errors are not (also) on the terminal."""
        from torch.distributed.elastic.multiprocessing.api import Std, to_map

        log = stderrs.get(local_rank)
        tee = to_map(getattr(self._logs_specs, "_tee", Std.NONE), max(stderrs, default=0) + 1)
        if not log or tee.get(local_rank, Std.NONE) in (Std.ERR, Std.ALL):
            return None
        return os.path.dirname(log)

    def restarting(self, restart: int) -> None:
        self.say(f"restarting every rank (restart {restart} of {self._max_restarts}).")

    def regrouping(self) -> None:
        self.say("a node joined the job; restarting every rank at the new world size.")


def _refusal(failure: Any) -> str | None:
    """The sentence of the `ConfigurationError` that ended the rank of `failure` (a
    `ProcessFailure`, or None), as `lite_core.launchers.rank` marks it in the error file."""
    message = getattr(failure, "message", None)
    info = message.get("extraInfo") if isinstance(message, dict) else None
    sentence = info.get(REFUSAL_KEY) if isinstance(info, dict) else None
    return sentence if isinstance(sentence, str) else None


@contextlib.contextmanager
def _reporting_agent(reporter: _Reporter, folder: str) -> Iterator[None]:
    """Make `elastic_launch` run torch's `LocalElasticAgent` with Lite's lines added.

    `launch_agent` builds its agent from the module's `LocalElasticAgent` name; for the duration
    of one launch that name is the subclass below, so everything else stays torch's own code."""
    import torch.distributed.launcher.api as api
    from torch.distributed.elastic.agent.server.api import WorkerState

    base = api.LocalElasticAgent

    class ReportingAgent(base):  # type: ignore[misc, valid-type]
        def _monitor_workers(self, worker_group: Any) -> Any:
            result = super()._monitor_workers(worker_group)
            if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and result.failures:
                stderrs = dict(getattr(self._pcontext, "stderrs", {}) or {})
                reporter.failed(result.failures, folder, stderrs)
            return result

        def _restart_workers(self, worker_group: Any) -> None:
            if worker_group.state == WorkerState.HEALTHY:
                reporter.regrouping()
            else:
                reporter.restarting(worker_group.spec.max_restarts - self._remaining_restarts)
            super()._restart_workers(worker_group)

        def _start_workers(self, worker_group: Any) -> Any:
            _clear(folder)  # the previous attempt's notes would blame its ranks
            return super()._start_workers(worker_group)

    api.LocalElasticAgent = ReportingAgent
    try:
        yield
    finally:
        api.LocalElasticAgent = base


def _rendezvous_environment(config: Any) -> dict[str, str]:
    """The agent's variables for a rendezvous that nodes may join after its first round: any
    rendezvous but the static one with more than one node (unless the user set the variable)."""
    if config.max_nodes > 1 and config.rdzv_backend != "static" and _STORE_SHARING_OFF not in os.environ:
        return {_STORE_SHARING_OFF: "1"}
    return {}


@contextlib.contextmanager
def _rank_environment() -> Iterator[str]:
    """Export to the ranks this process's pid (`lite_core.launchers.rank` dies with it) and a
    folder, `LITE_FAILURE_DIR`, where each failing rank notes when it failed; yields the folder."""
    folder = tempfile.mkdtemp(prefix="lite-run-failures-")
    try:
        with _exported({FAILURE_DIR_VARIABLE: folder, LAUNCHER_PID_VARIABLE: str(os.getpid())}):
            yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _exported(added: dict[str, str]) -> Iterator[None]:
    """`added` in this process's environment (the agent's, and its ranks') for the duration."""
    before = export_environ(**added)
    try:
        yield
    finally:
        restore_environ(before)


def _clear(folder: str) -> None:
    for name in os.listdir(folder):
        with contextlib.suppress(OSError):
            os.remove(os.path.join(folder, name))


@contextlib.contextmanager
def quiet_agent() -> Iterator[None]:
    """Keep the agent's own log lines off the terminal unless the user asked for them with
    `LOGLEVEL`: they stop at a handler that drops them (torch sets each module logger's level
    itself, so a level on the parent would not do)."""
    if os.environ.get("LOGLEVEL"):
        yield
        return
    loggers = [logging.getLogger(name) for name in _AGENT_LOGGERS]
    sink = logging.NullHandler()
    previous = [logger.propagate for logger in loggers]
    for logger in loggers:
        logger.addHandler(sink)
        logger.propagate = False
    try:
        yield
    finally:
        for logger, propagate in zip(loggers, previous):
            logger.removeHandler(sink)
            logger.propagate = propagate

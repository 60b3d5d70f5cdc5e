"""A fork server for the test suite: one process per test environment that has imported torch
once, and forks a copy of itself for each `python ...` a test (or a launcher inside a test) starts.

Importing torch costs each new interpreter 1.5-3 CPU-seconds, and the suite starts about a
thousand of them on 2 cores: most of CI's time. `lite_forkserver_hook.py` (run from a `.pth` file
in the test environment when `LITE_TEST_FORKSERVER` names this server's socket) turns a new
interpreter into a stand-in: it sends its command line, environment, working directory and open
file descriptors here, and waits. The server forks a proxy, and the proxy forks the program, which
takes them over and runs as `python` would (`__main__`, `sys.argv`, `sys.path`, `sitecustomize`).
The stand-in relays signals to the program and exits as the program exits (the same code, or
killed by the same signal).

What a forked program sees that a fresh one would not, and how it is made equal:

- Its parent: `os.getppid()` answers the stand-in's parent, read live from /proc. The proxy lives
  as long as the stand-in's parent, so a parent-death signal the program arms
  (`prctl(PR_SET_PDEATHSIG)`, as Lite's ranks do) fires when that parent dies, as it would.
- A stand-in that is killed takes its program with it (the proxy watches it).
- The thread count that `OMP_NUM_THREADS` set when OpenMP loaded: set again with
  `torch.set_num_threads`. Random seeds: torch's and numpy's global generators are seeded afresh.
- What cannot be mirrored starts a fresh interpreter (the hook decides): an environment variable
  read when torch imports that differs from the server's (`import_time_environment`), interpreter
  options other than -u, -B, -s and -W, and a console script whose native main reads the process's
  own command line, which in a fork is the server's (`_NATIVE_ARGV` in the hook).
- Not mirrored: its pid, which is not the one its `Popen` holds (that is the stand-in's). A test
  that matches what a program names by its pid gives the program an id of its own instead
  (`start_life` in the root conftest.py).
- Its heap: the server freezes what its preloads built (`gc.freeze()`), so a program's full
  collections skip those objects, as they would skip objects that are not there.
- A process-group leader (a job that a test signals as a group; a rank that torch's elastic agent
  starts in a session of its own, which it stops with `killpg`): the program calls `setsid()` and
  leads a group of its own, its descendants in it. The stand-in, the group's leader, relays each
  signal to the program's whole group, and when the stand-in is killed the proxy kills that group,
  so a group's signal reaches what the program started, as it would reach a fresh one's children.
  (A signal sent to the stand-in alone reaches the program's group too.)

It is test infrastructure only: nothing in the packages knows of it.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
from typing import Any

#: Environment variables whose value is read while torch imports (or is baked in at startup): a
#: program whose value differs from the server's starts as a fresh interpreter.
IMPORT_TIME_PREFIXES = ("LD_", "TORCH_LOGS", "TORCH_CPP_LOG_LEVEL", "PYTORCH_", "MKL_", "KMP_", "GOMP_", "OMP_",
                        "CUDA_", "NVIDIA_", "MALLOC_", "PYTHONHOME", "PYTHONMALLOC", "PYTHONHASHSEED",
                        "PYTHONNOUSERSITE", "PYTHONSAFEPATH", "PYTHONUSERBASE", "PYTHONIOENCODING",
                        "PYTHONUTF8", "PYTHONDEVMODE", "PYTHONOPTIMIZE", "PYTHONVERBOSE", "PYTHONINSPECT",
                        "PYTHONTRACEMALLOC", "PYTHONPROFILEIMPORTTIME", "PYTHONWARNDEFAULTENCODING",
                        "PYTHONSTARTUP", "PYTHONBREAKPOINT", "LOGLEVEL")
#: More of them, when the module that reads them is among the preloads.
READ_BY_MODULE = {"deepspeed": ("DS_",), "torch_xla": ("PJRT_", "XLA_", "TPU_"),
                  "torch._inductor.config": ("TORCHINDUCTOR_",), "torch._dynamo.config": ("TORCH_COMPILE", "TORCHDYNAMO_"),
                  "transformers": ("HF_", "TRANSFORMERS_", "USE_TORCH", "USE_TF", "USE_FLAX"), "torchao": ("TORCHAO_",)}
#: Variables of those prefixes that a forked program applies itself.
EXEMPT = ("OMP_NUM_THREADS",  # set again by the child (torch.set_num_threads)
          "TORCHINDUCTOR_CACHE_DIR")  # read when inductor compiles, not when it imports


def import_time_prefixes() -> tuple[str, ...]:
    """The prefixes of the variables read when this process's modules were imported."""
    more = [prefix for module, prefixes in READ_BY_MODULE.items() if module in sys.modules for prefix in prefixes]
    return (*IMPORT_TIME_PREFIXES, *more)


def import_time_environment(environ: dict[str, str]) -> dict[str, str]:
    """The variables of `environ` that must equal the server's for a fork to run its program."""
    prefixes = import_time_prefixes()
    return {k: v for k, v in environ.items() if k.startswith(prefixes) and k not in EXEMPT}


#: Modules every forked program starts with.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.run", "torch.distributed.fsdp",
           "torch.distributed.checkpoint", "torch.multiprocessing", "torch._dynamo", "numpy")

_HERE = __file__
_HEADER = struct.Struct("!I")
_STATUS = struct.Struct("!ii")  # (0, exit code), (1, signal number), or (2, 0): the stand-in's parent died


# -- the server ---------------------------------------------------------------------------------
def serve(path: str) -> None:
    """Listen on the Unix socket `path` and start a program for every request, until killed."""
    base_path = list(sys.path)
    import torch  # noqa: F401  (torch's import starts one idle native thread, as every user's process has
    # when a DataLoader forks its workers)

    torch_threads = _threads()
    for name in PRELOAD:
        __import__(name)
    if _threads() > torch_threads:
        raise SystemExit(f"the fork server's preloads started more threads than importing torch does: {PRELOAD}")
    for name in [n for n in os.environ.get("LITE_TEST_FORKSERVER_PRELOAD", "").split(",") if n]:
        if _safe_to_preload(name, torch_threads):
            __import__(name)
        else:
            print(f"not preloaded: importing {name} fails or starts a thread", file=sys.stderr, flush=True)
    # What the preloads built is never garbage: moved out of the collector's generations, a forked
    # program's full collections neither walk it nor write to its pages (which would copy them).
    gc.collect()
    gc.freeze()
    info = {"executable": sys.executable, "prefix": sys.prefix, "pid": os.getpid(),
            "environment": import_time_environment(dict(os.environ)),
            "prefixes": list(import_time_prefixes()), "exempt": list(EXEMPT)}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(128)
    listener.settimeout(0.1)  # to reap the proxies that ended in between
    with open(path + ".json", "w") as handle:
        json.dump(info, handle)
    while True:
        try:
            connection, _ = listener.accept()
        except TimeoutError:
            connection = None
        if connection is not None:
            _start(connection, listener, base_path)
        _reap_proxies()


def _threads() -> int:
    """This process's threads, Python's and native ones (a fork copies only the forking thread: a
    lock another thread held would stay held in the child)."""
    return max(len(os.listdir("/proc/self/task")), threading.active_count())


def _safe_to_preload(name: str, threads: int) -> bool:
    """Whether importing `name` succeeds without starting a thread, tried in a forked probe."""
    pid = os.fork()
    if pid == 0:
        try:
            __import__(name)
            os._exit(0 if _threads() <= threads else 3)
        except BaseException:
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def _start(connection: socket.socket, listener: socket.socket, base_path: list[str]) -> None:
    try:
        request, fds = _receive(connection)
    except (OSError, ValueError):
        connection.close()
        return
    if os.environ.get("LITE_TEST_FORKSERVER_DEBUG"):
        print(f"fork {request['kind']} {request['target'][:80]!r}", file=sys.stderr, flush=True)
    if os.fork() == 0:
        listener.close()
        _proxy(request, fds, connection, base_path)  # never returns
    for fd in fds:
        os.close(fd)
    connection.close()


def _receive(connection: socket.socket) -> tuple[dict[str, Any], list[int]]:
    connection.settimeout(30)  # a hang guard: the stand-in sends its request at once
    data, fds, _, _ = socket.recv_fds(connection, 1 << 20, 256)
    if len(data) < _HEADER.size:
        raise ValueError("short request")
    (size,) = _HEADER.unpack_from(data)
    data = data[_HEADER.size:]
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise ValueError("truncated request")
        data += chunk
    connection.settimeout(None)
    return json.loads(data), list(fds)


def _reap_proxies() -> None:
    """Wait for the proxies that ended (waiting adds their CPU time, and their programs', to this
    process's children's: the suite reports each environment's CPU-seconds from it)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _log_cpu(env: dict[str, str], usage: Any) -> None:
    """With `LITE_TEST_CPU_LOG=<folder>`, append the program's CPU-seconds (its own and those of the
    children it waited for) to the test that started it (`LITE_TEST_NODEID`, which the root
    conftest.py sets during each test): a forked program is the server's child, so the test's own
    `os.times()` cannot see it. `tools/cpu_report.py` adds these rows to the tests'."""
    folder, nodeid = env.get("LITE_TEST_CPU_LOG"), env.get("LITE_TEST_NODEID")
    if not folder or not nodeid:
        return
    try:
        with open(os.path.join(folder, f"forked-{os.getppid()}.tsv"), "a") as log:
            log.write(f"{nodeid}\t{usage.ru_utime + usage.ru_stime:.2f}\t0\n")
    except OSError:
        pass


# -- the proxy: the program's parent, alive while the stand-in's parent is ------------------------
def _proxy(request: dict[str, Any], fds: list[int], connection: socket.socket, base_path: list[str]) -> None:
    """Fork the program and wait: report its exit to the stand-in; kill it when the stand-in dies
    (killed: it sends no report); exit when the stand-in's parent dies, so that a parent-death
    signal the program armed (`prctl(PR_SET_PDEATHSIG)`, as Lite's ranks do) fires as it would."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        stand_in = os.pidfd_open(request["stand_in"])
        parent = os.pidfd_open(request["parent"])
    except ProcessLookupError:
        os._exit(1)
    program = os.fork()
    if program == 0:
        os.close(stand_in)
        os.close(parent)
        _become(request, fds, connection, base_path)  # never returns
    for fd in fds:
        os.close(fd)
    exited = os.pidfd_open(program)
    try:
        connection.sendall(struct.pack("!i", program))
    except OSError:
        pass
    ready, _, _ = select.select([exited, stand_in, parent], [], [])
    if exited in ready:
        _, status, usage = os.wait4(program, 0)
        _log_cpu(request["env"], usage)
        killed = os.WIFSIGNALED(status)
        report = _STATUS.pack(1, os.WTERMSIG(status)) if killed else _STATUS.pack(0, os.waitstatus_to_exitcode(status))
        try:
            connection.sendall(report)
        except OSError:
            pass
    elif stand_in in ready:
        try:
            if request.get("group"):
                os.killpg(program, signal.SIGKILL)  # the stand-in's group was killed: the program's is
            else:
                os.kill(program, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _log_cpu(request["env"], os.wait4(program, 0)[2])
    else:  # the stand-in's parent died: the stand-in waits for the program without a report
        try:
            connection.sendall(_STATUS.pack(2, 0))
        except OSError:
            pass
    os._exit(0)


# -- the program ----------------------------------------------------------------------------------
def _become(request: dict[str, Any], fds: list[int], connection: socket.socket, base_path: list[str]) -> None:
    """In the forked program: take over the stand-in's descriptors, environment and command line,
    run the program, and exit as the interpreter would. The program keeps its end of the
    connection (close-on-exec, above every descriptor it takes over) until it exits: a stand-in
    whose parent died waits for that, so that it is seen as long as its program runs."""
    import fcntl

    if request.get("group"):
        os.setsid()  # leads its own group (and session), as the stand-in does
    floor = max([*request["fds"], *fds, connection.fileno(), 2]) + 1
    fcntl.fcntl(connection.fileno(), fcntl.F_DUPFD_CLOEXEC, floor)
    connection.close()
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _take_descriptors(request["fds"], fds)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _standard_streams(request)
    _pretend_parent(request["stand_in"])
    _threads_from_environment()
    _fresh_random_seeds()
    if os.environ.get("LITE_TEST_FORKSERVER_DEBUG"):
        import atexit

        preloaded = set(sys.modules)
        atexit.register(_note_imports, preloaded)
    code = _run(request, base_path)
    raise SystemExit(code)


def _note_imports(preloaded: set[str]) -> None:
    with open(os.environ["LITE_TEST_FORKSERVER_DEBUG"], "a") as log:
        print("imported", " ".join(sorted(set(sys.modules) - preloaded)), file=log)


def _take_descriptors(numbers: list[int], fds: list[int]) -> None:
    """Put each received descriptor at the number it had in the stand-in, and close the server's
    standard streams that the stand-in did not have."""
    import fcntl

    floor = max([*numbers, *fds, 2]) + 1
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor) for fd in fds]
    for fd in fds:
        os.close(fd)
    for number in (0, 1, 2):
        if number not in numbers:
            try:
                os.close(number)
            except OSError:
                pass
    for number, fd in zip(numbers, high):
        os.dup2(fd, number, inheritable=True)
        os.close(fd)


def _standard_streams(request: dict[str, Any]) -> None:
    import io

    unbuffered = request["unbuffered"] or bool(request["env"].get("PYTHONUNBUFFERED"))
    streams = []
    for fd, mode in ((0, "r"), (1, "w"), (2, "w")):
        try:
            os.fstat(fd)
        except OSError:
            streams.append(None)
            continue
        raw = io.FileIO(fd, mode + "b", closefd=False)
        if mode == "r":
            stream = io.TextIOWrapper(io.BufferedReader(raw), encoding="utf-8", errors="strict")
        else:
            interactive = os.isatty(fd)
            buffer = raw if unbuffered else io.BufferedWriter(raw)
            stream = io.TextIOWrapper(buffer, encoding="utf-8", errors="backslashreplace" if fd == 2 else "strict",
                                      line_buffering=interactive or fd == 2 or unbuffered, write_through=unbuffered)
        streams.append(stream)
    sys.stdin, sys.stdout, sys.stderr = streams
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = streams
    if request["env"].get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()


def _pretend_parent(stand_in: int) -> None:
    """`os.getppid()` answers the stand-in's parent (read live: after that parent dies, the one the
    stand-in was given to); a process this one forks sees its real parent again."""
    real_getppid = os.getppid

    def stand_in_parent() -> int:
        try:
            with open(f"/proc/{stand_in}/stat") as handle:
                return int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return 1

    os.getppid = stand_in_parent
    os.register_at_fork(after_in_child=lambda: setattr(os, "getppid", real_getppid))


def _fresh_random_seeds() -> None:
    """A fresh interpreter seeds torch's default generator and numpy's from the system's entropy;
    forked, every program would share the server's (Python's `random` reseeds itself at a fork)."""
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _threads_from_environment() -> None:
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


def _run(request: dict[str, Any], base_path: list[str]) -> int:
    import importlib
    import runpy

    import __main__

    kind, target, args = request["kind"], request["target"], request["args"]
    pythonpath = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    if kind == "script":
        first = os.path.dirname(os.path.realpath(target))
    elif kind == "module":
        first = os.getcwd()
    else:
        first = ""
    sys.path[:] = [first, *pythonpath, *base_path[1:]]
    importlib.invalidate_caches()
    _site_customization()
    sys.orig_argv = request["orig_argv"]
    sys.dont_write_bytecode = request["dont_write_bytecode"] or bool(request["env"].get("PYTHONDONTWRITEBYTECODE"))
    for option in request["warnoptions"]:
        sys.warnoptions.append(option)
    if request["warnoptions"] or request["env"].get("PYTHONWARNINGS"):
        import warnings

        for option in [*request["env"].get("PYTHONWARNINGS", "").split(","), *request["warnoptions"]]:
            if option:
                warnings._setoption(option)  # type: ignore[attr-defined]
    try:
        if kind == "script":
            sys.argv = [target, *args]
            main = __main__.__dict__
            for name in [key for key in main if key != "__builtins__"]:
                del main[name]
            main.update(__name__="__main__", __file__=target, __doc__=None, __package__=None,
                        __spec__=None, __loader__=None, __cached__=None)
            with open(target, "rb") as handle:
                source = handle.read()
            exec(compile(source, target, "exec"), main)
        elif kind == "module":
            sys.argv = ["-m", *args]
            runpy._run_module_as_main(target, alter_argv=True)  # type: ignore[attr-defined]
        else:  # -c CODE, or - (the program on standard input)
            sys.argv = ["-c" if kind == "code" else "-", *args]
            main = __main__.__dict__
            main["__name__"] = "__main__"
            main.pop("__file__", None)
            source, name = (target, "<string>") if kind == "code" else (sys.stdin.read(), "<stdin>")
            exec(compile(source, name, "exec"), main)
    except SystemExit:
        raise
    except BaseException as error:  # print it as the interpreter would, without this file's frames
        tb = error.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == _HERE:
            tb = tb.tb_next
        sys.excepthook(type(error), error.with_traceback(tb), tb)
        if isinstance(error, KeyboardInterrupt):
            _flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        return 1
    return 0


def _site_customization() -> None:
    """Import the `sitecustomize` that this program's path finds, as `site` does at startup,
    where it is not the one the server imported (a folder on PYTHONPATH may hold one)."""
    import importlib.machinery

    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    loaded = sys.modules.get("sitecustomize")
    if spec is None or (loaded is not None and getattr(loaded, "__file__", None) == spec.origin):
        return
    sys.modules.pop("sitecustomize", None)
    import sitecustomize  # noqa: F401


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass


# -- the test session's side ------------------------------------------------------------------
def start(folder: str, environ: dict[str, str], ready_within: float = 300.0) -> tuple[Any, str]:
    """Start a server for this interpreter in `folder` and install the hook in its environment;
    returns the server's process and the socket path to export as `LITE_TEST_FORKSERVER`.
    `ready_within` is a hang guard: importing torch takes seconds. The server leads its own
    process group, which holds its proxies and programs: `stop` kills the group."""
    import subprocess

    _install_hook()
    path = os.path.join(folder, "sock")
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import lite_forkserver; lite_forkserver.serve({path!r})"
    env = {k: v for k, v in environ.items() if k not in ("PYTHONPATH", "LITE_TEST_FORKSERVER")}
    log = open(os.path.join(folder, "server.log"), "w")
    server = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=folder, stdout=subprocess.DEVNULL,
                              stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    deadline = time.monotonic() + ready_within
    while not os.path.exists(path + ".json"):
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise RuntimeError(f"the fork server did not start: see {folder}/server.log")
        time.sleep(0.05)
    return server, path


def stop(server: Any) -> None:
    """Kill the server, its proxies and the programs still running."""
    try:
        os.killpg(server.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.wait(timeout=60)  # a hang guard: SIGKILL ends it at once


def _install_hook() -> None:
    """A `.pth` line in this virtual environment's site-packages that runs the hook when
    `LITE_TEST_FORKSERVER` is set (and does nothing otherwise)."""
    import sysconfig

    if sys.prefix == sys.base_prefix:
        raise RuntimeError("the fork server's hook goes into a virtual environment only")
    hook = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lite_forkserver_hook.py")
    run = ("with open(p) as f: exec(compile(f.read(), p, 'exec'), "
           "{'__file__': p, '__name__': '__lite_forkserver_hook__'})")
    line = f"import os; exec({run!r}, {{'p': {hook!r}}}) if os.environ.get('LITE_TEST_FORKSERVER', '0') != '0' else None\n"
    target = os.path.join(sysconfig.get_paths()["purelib"], "lite_test_forkserver.pth")
    try:
        with open(target) as handle:
            if handle.read() == line:
                return
    except OSError:
        pass
    with open(target + ".tmp", "w") as handle:
        handle.write(line)
    os.replace(target + ".tmp", target)


if __name__ == "__main__":
    raise SystemExit("run it as `python -c 'import lite_forkserver; lite_forkserver.serve(PATH)'`")

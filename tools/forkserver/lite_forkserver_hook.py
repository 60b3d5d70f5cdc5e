"""The stand-in side of `lite_forkserver.py`, executed by a `.pth` line while `site` starts a new
interpreter of a test environment: when `LITE_TEST_FORKSERVER` names a running server whose
interpreter and import-time environment are this one's, and the command line is one the server
can run (`python [-u] [-B] [-W opt] (SCRIPT | -m MODULE | -c CODE) ARGS`), hand the program to a
forked copy of the server and exit as it exits. Anything else starts as usual.

Only the standard library, and nothing imported at module level beyond what `site` has loaded."""


def _lite_forkserver_hand_over() -> None:
    import os
    import sys

    path = os.environ.get("LITE_TEST_FORKSERVER", "")
    if path in ("", "0") or sys.flags.isolated or sys.flags.ignore_environment or sys.flags.optimize:
        return
    leader_for_cleanup = os.environ.pop("LITE_TEST_FORKSERVER_CLEANUP_GROUP", "") == "1"  # this process only
    # A process-group leader (a job a test signals as a group, a rank torch's elastic agent starts
    # in a session of its own): its program leads a group of its own, where the signals go.
    group = os.getpgid(0) == os.getpid() and not leader_for_cleanup
    parsed = _parse(list(getattr(sys, "orig_argv", [])))
    if parsed is None:
        _note("interpreter options")
        return
    import json

    try:
        with open(path + ".json") as handle:
            server = json.load(handle)
    except (OSError, ValueError):
        return
    if server["executable"] != sys.executable or server["prefix"] != sys.prefix:
        _note("another interpreter")
        return
    prefixes = tuple(server["prefixes"])
    mine = {k: v for k, v in os.environ.items() if k.startswith(prefixes) and k not in server["exempt"]}
    if mine != server["environment"]:
        differ = sorted(k for k in {*mine, *server["environment"]} if mine.get(k) != server["environment"].get(k))
        _note(f"import-time variables differ: {differ}")
        return
    kind, target, args, flags, warnoptions = parsed
    if kind == "script" and not os.path.isfile(target):
        return  # python says why
    if kind == "script":
        target = os.path.abspath(target)
        if os.path.basename(target) in _NATIVE_ARGV:
            _note("a program that reads the process's command line natively")
            return
    _run_in_fork(path, {
        "kind": kind, "target": target, "args": args, "warnoptions": warnoptions,
        "unbuffered": "u" in flags, "dont_write_bytecode": "B" in flags,
        "orig_argv": list(sys.orig_argv), "cwd": os.getcwd(), "env": dict(os.environ),
        "stand_in": os.getpid(), "parent": os.getppid(), "group": group,
    })


#: Console scripts whose `main` is native code that reads the process's own command line (the
#: kernel's, which in a forked program is the server's), not `sys.argv`: torchft's lighthouse (Rust).
_NATIVE_ARGV = ("torchft_lighthouse",)


def _parse(argv: list[str]):  # -> (kind, target, args, flags, warnoptions) | None
    flags, warnoptions, i = "", [], 1
    while i < len(argv):
        arg = argv[i]
        if arg in ("-c", "-m"):
            if i + 1 >= len(argv):
                return None
            return ("code" if arg == "-c" else "module"), argv[i + 1], argv[i + 2:], flags, warnoptions
        if arg == "-":
            return "stdin", "-", argv[i + 1:], flags, warnoptions
        if not arg.startswith("-"):
            return "script", arg, argv[i + 1:], flags, warnoptions
        if arg.startswith("-W"):
            if arg == "-W":
                if i + 1 >= len(argv):
                    return None
                warnoptions.append(argv[i + 1])
                i += 2
            else:
                warnoptions.append(arg[2:])
                i += 1
            continue
        if len(arg) < 2 or any(flag not in "uBs" for flag in arg[1:]):
            return None
        flags += arg[1:]
        i += 1
    return None


def _open_descriptors(skip: int) -> list[int]:
    import fcntl
    import os

    numbers = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd == skip:
            continue
        try:
            if fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC:
                continue
        except OSError:
            continue  # the listing's own descriptor, closed by now
        numbers.append(fd)
    return sorted(numbers)


def _run_in_fork(path: str, request: dict) -> None:
    import json
    import os
    import signal
    import socket
    import struct

    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(path)
    except OSError:
        connection.close()
        return
    numbers = _open_descriptors(connection.fileno())
    request["fds"] = numbers
    body = json.dumps(request).encode()
    message = struct.pack("!I", len(body)) + body
    # The program may run (and print that it is ready) before this process hears its pid, so the
    # signals are caught from the request on: one that comes before the pid is passed on once it is
    # known (under load a launcher still installing its relay was killed by a SIGTERM meant for the
    # program). Should the request fail, the interpreter starts as usual, with its own handlers.
    child = None
    early: list[int] = []

    def relay(signum, frame) -> None:
        if child is None:
            early.append(signum)
            return
        try:
            if request["group"]:
                os.killpg(child, signum)  # what the group received: the program and what it started
            else:
                os.kill(child, signum)
        except ProcessLookupError:
            pass

    relayed = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
    before = {sig: signal.signal(sig, relay) for sig in relayed}
    try:
        socket.send_fds(connection, [message[:65536]], numbers)
        if len(message) > 65536:
            connection.sendall(message[65536:])
        header = _exactly(connection, 4)
    except OSError:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        connection.close()
        for signum in early:
            os.kill(os.getpid(), signum)
        return
    if header is None:
        os._exit(1)
    (child,) = struct.unpack("!i", header)
    while early:
        relay(early.pop(0), None)
    status = _exactly(connection, 8)
    if status is None:
        sys_stderr = os.fdopen(2, "w", closefd=False)
        sys_stderr.write("lite_forkserver: the fork server went away\n")
        sys_stderr.flush()
        os._exit(1)
    how, value = struct.unpack("!ii", status)
    if how == 2:  # the parent died; the program lives on unless it armed a parent-death signal
        while connection.recv(4096):  # until it ends (it holds its end of the connection)
            pass
        os._exit(1)
    if how == 1:
        if value not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(value, signal.SIG_DFL)
        os.kill(os.getpid(), value)
        os._exit(128 + value)
    os._exit(value)


def _exactly(connection, size: int):  # -> bytes | None
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _note(reason: str) -> None:
    """With `LITE_TEST_FORKSERVER_DEBUG=<file>`: why this interpreter starts fresh."""
    import os
    import sys

    log = os.environ.get("LITE_TEST_FORKSERVER_DEBUG")
    if log:
        with open(log, "a") as handle:
            print(f"fresh start ({reason}): {sys.orig_argv[:4]}", file=handle)


_lite_forkserver_hand_over()

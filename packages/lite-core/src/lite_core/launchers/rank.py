"""The program every rank of `lite run` runs: `python -m lite_core.launchers.rank [-m] TARGET ARGS`
runs the script TARGET (or, with `-m`, the module) as `python TARGET ARGS` would, with three
additions:

- it dies with the launcher that started it (Linux parent-death signal), so a launcher killed
  even by SIGKILL leaves no rank behind;
- its body is wrapped in torch's `record`, so that an exception goes into the error file the
  elastic agent reads for its summary of the failure; the file is written whole or not at all
  (a temporary file, then renamed), since the agent may stop this rank in the middle of writing
  it and then read what is there;
- it exports `LITE_RESTART_COUNT`, the agent's attempt number (`TORCHELASTIC_RESTART_COUNT`);
- a refusal of the user's configuration (a `ConfigurationError`: its one sentence names what was
  wrong and the fix) ends the rank with exit code 2 and no traceback; the error file marks it
  (`REFUSAL_KEY`), so that the launcher says the sentence once, in one line, for every rank.
  Every other exception keeps its full traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
from typing import TYPE_CHECKING

from lite_core.environ import LAUNCHER_PID_VARIABLE
from lite_core.errors import ConfigurationError
from lite_core.launchers.supervision import die_with_parent

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

#: Exported to every rank: 0 on the first attempt, then 1, 2, ... after each restart.
RESTART_VARIABLE = "LITE_RESTART_COUNT"
#: The key of the error file's `extraInfo` that holds a refusal's sentence (see `is_refusal`).
REFUSAL_KEY = "liteRefusal"
#: The exit code of a rank whose configuration Lite refused (as `lite run`'s own refusals).
REFUSAL_EXIT_CODE = 2


def is_refusal(err: BaseException) -> bool:
    """Whether `err` is Lite refusing the user's configuration (`ConfigurationError` and its
    subclasses): its sentence says all, so the rank ends without a traceback."""
    return isinstance(err, ConfigurationError)


def arguments(target: str, args: list[str], module: bool = False) -> list[str]:
    """The arguments of this module (`python -m lite_core.launchers.rank ...`) that run `target args`."""
    return [*(["-m"] if module else []), target, *args]


def main(argv: list[str]) -> None:
    """Run the script or module named in `argv` (`[-m] TARGET ARGS`) as this rank."""
    from torch.distributed.elastic.multiprocessing.errors import record

    _die_with_launcher()
    os.environ[RESTART_VARIABLE] = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    module = argv[:1] == ["-m"]
    target, *args = argv[1:] if module else argv
    handler = _atomic_error_handler()
    try:
        record(_run, error_handler=handler)(target, args, module)
    except Exception as err:
        if not is_refusal(err):
            raise
        if not handler._get_error_file_path():  # no launcher reads an error file: say it here
            sys.stderr.write(f"{type(err).__name__}: {err}\n")
        sys.exit(REFUSAL_EXIT_CODE)


def _atomic_error_handler() -> ErrorHandler:
    """Torch's `ErrorHandler`, but it writes the error file to a temporary name and renames it.

    The agent reads every rank's error file once it has stopped the ranks; a rank stopped between
    torch's `open(..., "w")` and its write left an empty file there, which failed the agent itself
    (`JSONDecodeError`) instead of reporting the rank that failed first."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    class AtomicErrorHandler(ErrorHandler):
        _writing_to: str | None = None

        def _get_error_file_path(self) -> str | None:
            return self._writing_to or super()._get_error_file_path()

        def record_exception(self, e: BaseException) -> None:
            final = super()._get_error_file_path()
            if not final:
                super().record_exception(e)
                return
            self._writing_to = f"{final}.{os.getpid()}.partial"
            try:
                super().record_exception(e)
                if is_refusal(e):
                    _mark_refusal(self._writing_to, str(e))
                os.replace(self._writing_to, final)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self._writing_to)
                self._writing_to = None

    return AtomicErrorHandler()


def _mark_refusal(path: str, sentence: str) -> None:
    """Add the refusal's sentence to the error file torch's handler wrote at `path`."""
    with open(path) as handle:
        data = json.load(handle)
    data["message"]["extraInfo"][REFUSAL_KEY] = sentence
    with open(path, "w") as handle:
        json.dump(data, handle)


def _die_with_launcher() -> None:
    die_with_parent()
    launcher = os.environ.get(LAUNCHER_PID_VARIABLE, "")
    if launcher.isdigit() and os.getppid() != int(launcher):
        os._exit(1)  # the launcher died before the parent-death signal was armed


def _run(target: str, args: list[str], module: bool) -> None:
    if module:
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    sys.argv = [target, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python TARGET` puts it first
    runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])

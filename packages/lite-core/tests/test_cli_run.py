"""`lite run`'s command line, parsed in this process (no rank is started): torchrun's option
names, and one-sentence errors for what is missing or contradictory."""

from __future__ import annotations

import pytest

from lite_core.cli import build_parser, main


def parse(*argv: str) -> dict:
    args = vars(build_parser().parse_args(["run", *argv]))
    return {k: v for k, v in args.items() if k != "handler"}


def test_torchrun_option_names_mean_the_same_as_lites() -> None:
    torchrun = parse("--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                     "--master-port", "29500", "train.py", "--lr", "0.1")
    lite = parse("--devices", "2", "--num-nodes", "2", "--node-rank", "1", "--main-address", "10.0.0.1",
                 "--main-port", "29500", "train.py", "--lr", "0.1")
    underscores = parse("--nproc_per_node", "2", "--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1",
                        "--master_port", "29500", "train.py", "--lr", "0.1")
    assert torchrun == lite == underscores
    assert lite["devices"] == "2" and lite["script_args"] == ["--lr", "0.1"]


@pytest.mark.parametrize(("argv", "message"), [
    ((), "SCRIPT is missing: name the Python file to run after the options, e.g. `lite run --devices 2 train.py`."),
    (("-m",), "MODULE is missing after -m: name the module to run, e.g. `lite run -m mypkg.train`."),
    (("--tee", "train.py"), "--tee copies the rank logs to the terminal, so it needs --log-dir DIR as well."),
    (("--max-restarts", "-1", "train.py"), "--max-restarts -1 is negative: pass 0 or more restarts."),
    (("--standalone", "--nnodes", "2", "train.py"),
     "--standalone runs one node on a free port: drop --num-nodes/--nnodes and --main-port/--master-port."),
])
def test_a_bad_command_line_is_refused_in_one_sentence(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...],
                                                       message: str) -> None:
    assert main(["run", *argv]) == 2
    assert capsys.readouterr().err == f"lite run: error: {message}\n"

"""Checkpoints at an `s3://` URL in 2-process jobs (`tests/scripts/cloud_checkpoint.py`), against
moto's S3 server on 127.0.0.1 (the `s3_bucket` fixture): the same training saved to the bucket
and to a local folder gives identical checkpoints and resumes identically (and one process loads
what 2 saved, straight from the bucket), under ddp, fsdp
(sharded: torch distributed checkpoint's FsspecWriter; and one file) and model_parallel (dp1 x tp2,
and 2 pipeline stages); a server stopped in the
middle of an upload fails the save on every rank, leaves the previous checkpoint loadable and
the broken one refused; a missing bucket, refused credentials and an unreachable endpoint each
give one sentence on every rank; a job of two `lite run` nodes (c10d on loopback, each node with
a folder of its own, no common path) restarted by `--max-restarts 1` after a rank died resumes
from the latest complete checkpoint in the bucket (`tests/scripts/cloud_resume.py`), and so does the
same job preempted (every process gone) and started again elsewhere: one `lite run` of 2 processes
in a new folder, with nothing but the bucket."""

from __future__ import annotations

import hashlib
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

# A hang guard, far above a run's duration (about 40 s on 2 shared cores); every collective
# has the scripts' short timeout.
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

STRATEGIES = ["ddp", "fsdp", "fsdp_full", "model_parallel", "pipeline"]


def _digest(state: dict[str, Any]) -> str:
    """As `cloud_checkpoint.py` digests a state dict."""
    hasher = hashlib.sha256()
    for name in sorted(state):
        hasher.update(name.encode())
        hasher.update(state[name].detach().cpu().contiguous().numpy().tobytes())
    return hasher.hexdigest()[:16]


def _lines(stdout: str, prefix: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith(prefix)]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_bucket_holds_what_a_local_folder_holds_and_resumes_the_same(
        run_script: Any, output_of: Any, s3_server: Any, s3_bucket: str, tmp_path: Path, strategy: str) -> None:
    # One job trains twice: saving to a local folder, then to the bucket.
    remote = run_script("cloud_checkpoint.py", strategy, "train", f"{s3_bucket}/run", tmp_path / "run",
                        env=s3_server.env, timeout=300)
    assert remote.returncode == 0, output_of(remote)
    digests = _lines(remote.stdout, "digest")
    sharded = strategy in ("fsdp", "model_parallel", "pipeline")
    assert len(digests) == 4 + sharded and "equal False" not in remote.stdout, output_of(remote)
    assert digests[:4] == [line.removeprefix("local ") for line in _lines(remote.stdout, "local digest")]
    assert "local latest step-3" in remote.stdout, output_of(remote)
    saved = digests[0].split()[2]
    if sharded:  # `lite consolidate` read the shards from the bucket and wrote one file there
        assert digests[-1] == f"digest consolidated {saved}", output_of(remote)
    # Saved by 2 processes under `strategy`, loaded by this one process straight from the bucket.
    from lite_core import LightningLite

    content = LightningLite(accelerator="cpu").load(f"{s3_bucket}/run/step-2")
    assert _digest(content["model"]) == saved and content["step"] == 2
    assert "latest step-3" in remote.stdout, output_of(remote)
    assert not (Path(tmp_path) / "s3:").exists()


class _StoppedMidUpload(threading.Thread):
    """The test's side of the script's handshake: stop the S3 server when a rank's first write of
    `step-2` asks for it, start it again once both ranks have seen their save fail."""

    def __init__(self, server: Any, handshake: Path) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.handshake = handshake

    def run(self) -> None:
        self._wait_for("trigger")
        self.server.stop()
        (self.handshake / "stopped").touch()
        self._wait_for("failed-0")
        self._wait_for("failed-1")
        self.server.start()
        (self.handshake / "restarted").touch()

    def _wait_for(self, name: str) -> None:
        deadline = time.monotonic() + 300  # a hang guard: the script's own timeout ends the test first
        while not (self.handshake / name).exists() and time.monotonic() < deadline:
            time.sleep(0.05)


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "background"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_server_stopped_mid_upload_fails_the_save_everywhere_and_keeps_the_previous_checkpoint(
        run_script: Any, output_of: Any, s3_server: Any, s3_bucket: str, tmp_path: Path, strategy: str,
        blocking: bool) -> None:
    handshake = tmp_path / "handshake"
    handshake.mkdir()
    helper = _StoppedMidUpload(s3_server, handshake)
    helper.start()
    mode = "fault-blocking" if blocking else "fault-background"
    proc = run_script("cloud_checkpoint.py", strategy, mode, f"{s3_bucket}/run", handshake, env=s3_server.env,
                      timeout=300)
    helper.join(5)
    s3_server.start()
    assert proc.returncode == 0, output_of(proc)
    assert (handshake / "trigger").exists(), "no write reached the store: the fault was never planted"
    for rank in (0, 1):
        failed = rf"rank {rank} failed: Saving the checkpoint '{s3_bucket}/run/step-2' failed on rank \d with \w+"
        assert re.search(failed, proc.stdout), output_of(proc)
        assert f"rank {rank} previous: 1" in proc.stdout, output_of(proc)
        broken = rf"rank {rank} broken: The upload of the checkpoint '{s3_bucket}/run/step-2' never finished"
        assert re.search(broken, proc.stdout), output_of(proc)
        assert f"rank {rank} latest: step-1" in proc.stdout, output_of(proc)


class _ChecksCredentialsWhenAsked(threading.Thread):
    """The test's side of the `errors` mode's handshake: once the script has met the missing bucket
    and the unreachable endpoint, moto checks every key (this process runs the server)."""

    def __init__(self, handshake: Path) -> None:
        super().__init__(daemon=True)
        self.handshake = handshake

    def run(self) -> None:
        import moto.settings

        deadline = time.monotonic() + 300  # a hang guard: the script's own timeout ends the test first
        while not (self.handshake / "credentials").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        moto.settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
        (self.handshake / "checking").touch()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_store_that_refuses_or_is_gone_gives_one_sentence_on_every_rank(
        run_script: Any, output_of: Any, s3_server: Any, s3_bucket: str, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path, strategy: str) -> None:
    import moto.settings

    # The thread sets it; monkeypatch puts back the value the `s3_bucket` fixture set (any key passes).
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", moto.settings.INITIAL_NO_AUTH_ACTION_COUNT)
    helper = _ChecksCredentialsWhenAsked(tmp_path)
    helper.start()
    proc = run_script("cloud_checkpoint.py", strategy, "errors", f"{s3_bucket}/run", tmp_path, env=s3_server.env,
                      timeout=300)
    helper.join(5)
    assert proc.returncode == 0, output_of(proc)
    expected = {"missing bucket": ("FileNotFoundError", "create the bucket"),
                "wrong credentials": ("PermissionError", "check the credentials"),
                "unreachable endpoint": ("EndpointConnectionError", "check the store's endpoint")}
    for fault, (error, fix) in expected.items():
        for rank in (0, 1):
            for what in ("save", "load"):  # the ranks share stdout: one rank's line may run into the other's
                found = re.search(rf"rank {rank} {fault} {what}: (.*?\.)(?=rank \d|\n|$)", proc.stdout)
                message = found.group(1) if found else ""
                assert message.endswith(".") and ". " not in message, output_of(proc)
                assert fix in message, output_of(proc)
                if what == "save":
                    assert error in message, output_of(proc)


def _start_node(start_script: Any, port: int, node: int, base: str, out: Path, how: str, restarts: str,
                env: dict[str, str]) -> Any:
    """One `lite run` node of one process; node 0 hosts the c10d rendezvous store."""
    options = ("-m", "lite_core.cli", "run", "--accelerator", "cpu", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"bucket-{how}",
               "--rdzv-conf", f"join_timeout=60,last_call_timeout=1,close_timeout=5,is_host={int(node == 0)}",
               "--max-restarts", restarts)
    return start_script("cloud_resume.py", base, out, how, env=env, python_args=options)


@pytest.mark.timeout(800)  # a hang guard: four 2-process jobs, about 55 s on an idle machine
def test_a_restarted_or_preempted_job_resumes_from_the_latest_checkpoint_in_the_bucket(  # 2 nodes
        start_script: Any, free_tcp_port: Any, s3_server: Any, s3_bucket: str, tmp_path: Path) -> None:
    """Two `lite run` nodes on loopback, each with a folder of its own and no common path: a rank
    that dies restarts both (`--max-restarts 1`), and the job resumes from the bucket alone; a
    preempted job started again on another machine resumes the same way."""
    import json

    runs = {}
    for how, restarts in (("live", "0"), ("die", "1")):
        outs = [tmp_path / how / f"node{node}" for node in (0, 1)]
        port = free_tcp_port()
        nodes = []
        for node, out in enumerate(outs):
            out.mkdir(parents=True)
            nodes.append(_start_node(start_script, port, node, f"{s3_bucket}/{how}", out, how, restarts, s3_server.env))
        for node in nodes:
            stdout, stderr = node.communicate(timeout=300)  # a hang guard: the job takes about 30 s
            assert node.returncode == 0, f"{stdout}\n{stderr}"
        records = {}
        for out in outs:  # a rank writes into the folder of the node it ran on
            records.update({path.name: json.loads(path.read_text()) for path in out.glob("rank*.json")})
        runs[how] = [records[f"rank{rank}.json"] for rank in (0, 1)]
    assert any((tmp_path / "die" / f"node{node}" / "died").exists() for node in (0, 1)), \
        "rank 1 never died: the restart was not exercised"
    for uninterrupted, restarted in zip(runs["live"], runs["die"]):
        assert restarted["resumed_from"] == "epoch-1"  # the attempt after the death, on both nodes
        assert restarted["started_at"] == 1  # the second attempt trained epochs 1 and 2 only
        assert uninterrupted["resumed_from"] == "" and uninterrupted["started_at"] == 0
        assert restarted["weight"] == uninterrupted["weight"]

    # Preempted: every process of the 2-node job leaves after the first epoch's checkpoint. The job
    # is started again on "another machine": one `lite run` of 2 processes in a new folder, with
    # nothing but the bucket.
    outs = [tmp_path / "preempt" / f"node{node}" for node in (0, 1)]
    port = free_tcp_port()
    nodes = []
    for node, out in enumerate(outs):
        out.mkdir(parents=True)
        nodes.append(_start_node(start_script, port, node, f"{s3_bucket}/preempt", out, "preempt", "0", s3_server.env))
    for node in nodes:
        stdout, stderr = node.communicate(timeout=300)  # a hang guard, as above
        assert node.returncode != 0, f"{stdout}\n{stderr}"
    assert any((out / "preempted").exists() for out in outs), "the job was never preempted"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    job = start_script("cloud_resume.py", f"{s3_bucket}/preempt", elsewhere, "preempt", env=s3_server.env,
                       python_args=("-m", "lite_core.cli", "run", "--accelerator", "cpu", "--devices", "2"))
    stdout, stderr = job.communicate(timeout=300)
    assert job.returncode == 0, f"{stdout}\n{stderr}"
    for rank, uninterrupted in enumerate(runs["live"]):
        moved = json.loads((elsewhere / f"rank{rank}.json").read_text())
        assert moved["resumed_from"] == "epoch-1" and moved["started_at"] == 1
        assert moved["weight"] == uninterrupted["weight"]

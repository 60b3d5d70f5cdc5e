"""DiLoCo against ddp_ft across replica groups, and what each recovery path costs; run in the
test-torchft environment:

    hatch run test-torchft:python benchmarks/regions_bench.py [--steps 64] [--sync-every 8]

(`--steps`: inner steps per group, a multiple of `--sync-every`.)

Two replica groups of one process each on loopback (`_ft_worker.py`: a tiny model, the same batch
per process), a lighthouse in this process. Rows (written to benchmarks/results/regions.md, and
the recovery times to results/regions.json for `goodput.py`):

- bytes per inner step: the bytes each group hands to its cross-group all-reduce, over the steps,
  for `ddp_ft` (every step's gradients) and `diloco` with H = `--sync-every` (a pseudo-gradient
  every H steps); counted, not timed;
- seconds per inner step of group 0 (mean over the steps after the first 8), without and with
  stragglers: each group, independently, sleeps 40 ms on a random quarter of its steps. `ddp_ft`
  waits for the slower group at every step, `diloco` only at each sync, where one group's slow
  steps have had H steps to even out against the other's;
- the recovery paths, each in seconds and as a ratio of one steady `ddp_ft` step:
  - whole-job restart: `lite run --max-restarts 1` (2 processes, `_restart_job.py`), a worker's
    death to every worker training again (no checkpoint load: see `goodput.py`);
  - elastic scale-down: two `lite run --nnodes 1:2 --max-restarts 1` nodes of one process
    (`_elastic_job.py`), one node's launcher SIGKILLed, to the survivor training again alone (no
    checkpoint load);
  - `ddp_ft` drop: group 1 SIGKILLed, to group 0's next committed step (lighthouse heartbeat
    timeout 1 s, as `lite run --replica-groups` sets it); heal: the restarted group's process
    start to its first committed step;
  - `diloco` loss between syncs: group 1 SIGKILLed half-way through an interval, to group 0's next
    committed sync, and the inner steps group 1 lost (those since its last sync).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lite_core.plugins import find_free_port
from torchft_bench import WORKER, _env, _record_of_when, _records, failure, write_results

HERE = Path(__file__).resolve().parent
STRAGGLE = "0.25,0.04"  # each step of each group: a 40 ms pause with probability 1/4


def _start(out: Path, group: int, lighthouse: str, strategy: str, steps: int, sleep: float,
           **extra: str) -> subprocess.Popen[bytes]:
    env = _env(REPLICA_GROUP_ID=str(group), NUM_REPLICA_GROUPS="2", TORCHFT_LIGHTHOUSE=lighthouse,
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()), **extra)
    return subprocess.Popen([sys.executable, str(WORKER), str(out), strategy, str(steps), str(sleep)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _two_groups(lighthouse: str, strategy: str, steps: int, **extra: str) -> tuple[float, float]:
    """Group 0's mean seconds per inner step (after the first 8) and bytes sent per inner step,
    over `steps` inner steps (a step takes one loader batch per group)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        procs = [_start(out, g, lighthouse, strategy, 2 * steps, 0.0, **extra) for g in (0, 1)]
        for proc in procs:
            if proc.wait(timeout=600) != 0:
                raise RuntimeError(f"a group of {strategy} failed (exit {proc.returncode})")
        [record] = out.glob("steps-0-*")
        times = [t for _, _, t in _records(record)[1]]
        sent = json.loads(next(out.glob("calls-0-*.json")).read_text())["bytes"]
    return (times[-1] - times[8]) / (len(times) - 9), sum(sent) / len(times)


def diloco_loss(lighthouse: str, sync_every: int) -> tuple[float, int]:
    """Seconds from SIGKILL of group 1, half-way through an interval, to group 0's next committed
    sync; and the inner steps group 1 lost (since its last sync)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        extra = {"FT_SYNC_EVERY": str(sync_every)}
        group0, group1 = (_start(out, g, lighthouse, "diloco", 20 * sync_every, 0.02, **extra) for g in (0, 1))
        record1 = _record_of_when(out, "1", group1.pid)
        kill_after = sync_every + sync_every // 2  # inner steps: half-way through the second interval
        while len(_records(record1)[1]) < kill_after:
            time.sleep(0.005)
        os.kill(group1.pid, signal.SIGKILL)
        killed = time.time()
        group1.wait()
        lost = len(_records(record1)[1]) % sync_every  # a sync every H inner steps until the kill
        synced_at_kill = _records(_record_of_when(out, "0", group0.pid))[1][-1][1]
        while True:
            steps0 = _records(out / f"steps-0-{group0.pid}")[1]
            after = [t for _, committed, t in steps0 if committed > synced_at_kill and t > killed]
            if after:
                break
            if group0.poll() is not None:
                raise RuntimeError("group 0 ended before its next sync")
            time.sleep(0.02)
        group0.kill()
        group0.wait()
    return after[0] - killed, lost


def restart() -> float:
    """A worker's death to every worker training again under `lite run --max-restarts 1`."""
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-m", "lite_core.cli", "run", "--nproc-per-node=2", "--max-restarts=1",
                        str(HERE / "_restart_job.py"), out], env=_env(), check=True, timeout=600,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        died = float(Path(out, "died_at").read_text())
        return max(float(p.read_text()) for p in Path(out).glob("trained_rank*")) - died


def elastic(keep_alive: int | None = None) -> float:
    """Seconds from a node's death (its launcher SIGKILLed) to the survivor training again alone,
    under `lite run --nnodes 1:2 --max-restarts 1` on two nodes of one process (`_elastic_job.py`);
    the rendezvous gives a silent node up after 3 keep-alives (torch's default interval 5 s, or
    `keep_alive` seconds)."""
    port = find_free_port()
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)

        def node(index: int) -> subprocess.Popen[bytes]:
            rendezvous = f"join_timeout=60,last_call_timeout=1,close_timeout=5,is_host={int(index == 0)}"
            if keep_alive is not None:
                rendezvous += f",keep_alive_interval={keep_alive}"
            return subprocess.Popen(
                [sys.executable, "-m", "lite_core.cli", "run", "--nnodes", "1:2", "--nproc-per-node", "1",
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench",
                 "--rdzv-conf", rendezvous, "--max-restarts", "1", str(HERE / "_elastic_job.py"), str(out)],
                env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        nodes = [node(0), node(1)]
        deadline = time.monotonic() + 300
        while not (out / "waiting").exists():
            if any(n.poll() is not None for n in nodes) or time.monotonic() > deadline:
                raise RuntimeError("the two nodes did not reach step 3 together")
            time.sleep(0.02)
        os.kill(nodes[1].pid, signal.SIGKILL)  # the launcher: its worker dies with it
        killed = time.time()
        nodes[1].wait()
        if nodes[0].wait(timeout=300) != 0:
            raise RuntimeError("node 1 did not go on alone")
        return float((out / "trained_at").read_text()) - killed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--sync-every", type=int, default=8)
    options = parser.parse_args()
    if options.steps % options.sync_every or options.steps < 2 * options.sync_every:
        parser.error("--steps must be a multiple of --sync-every, at least two intervals")
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=1000)
    lighthouse = f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"
    h = {"FT_SYNC_EVERY": str(options.sync_every)}
    ft_step, ft_bytes = _two_groups(lighthouse, "ddp_ft", options.steps)
    lo_step, lo_bytes = _two_groups(lighthouse, "diloco", options.steps, **h)
    ft_slow, _ = _two_groups(lighthouse, "ddp_ft", options.steps, FT_STRAGGLE=STRAGGLE)
    lo_slow, _ = _two_groups(lighthouse, "diloco", options.steps, FT_STRAGGLE=STRAGGLE, **h)
    drop, heal_total, heal_step = failure(lighthouse)
    lost_s, lost_steps = diloco_loss(lighthouse, options.sync_every)
    server.shutdown()
    whole = statistics.median(restart() for _ in range(3))
    scale_down = statistics.median(elastic() for _ in range(3))
    scale_down_fast = statistics.median(elastic(keep_alive=1) for _ in range(3))
    H = options.sync_every
    chance, seconds = (float(v) for v in STRAGGLE.split(","))
    pause = chance * seconds  # the mean pause per step of one group: what no schedule can hide
    rows = [
        "| measurement | ddp_ft | diloco (H = {}) | ratio ddp_ft / diloco |".format(H),
        "| --- | --- | --- | --- |",
        f"| bytes to the cross-group all-reduce per inner step | {ft_bytes:.0f} | {lo_bytes:.0f} | {ft_bytes / lo_bytes:.2f} |",
        f"| seconds per inner step | {ft_step * 1e3:.2f} ms | {lo_step * 1e3:.2f} ms | {ft_step / lo_step:.2f} |",
        f"| seconds per inner step, stragglers ({chance:g} of steps, {seconds * 1e3:.0f} ms) | {ft_slow * 1e3:.2f} ms | {lo_slow * 1e3:.2f} ms |"
        f" {ft_slow / lo_slow:.2f} |",
        f"| added by stragglers per inner step (each group's own pauses: {pause * 1e3:.0f} ms) |"
        f" {(ft_slow - ft_step) * 1e3:.2f} ms | {(lo_slow - lo_step) * 1e3:.2f} ms |"
        f" {(ft_slow - ft_step) / (lo_slow - lo_step):.2f} |",
    ]
    recovery = {
        "step_s": ft_step, "inner_step_s": lo_step, "sync_every": H,
        "restart_s": whole, "elastic_s": scale_down, "elastic_keep_alive_1_s": scale_down_fast,
        "ddp_ft_drop_s": drop, "ddp_ft_heal_s": heal_total, "ddp_ft_heal_step_s": heal_step,
        "diloco_drop_s": lost_s, "diloco_lost_inner_steps": lost_steps,
    }
    rows += [
        "",
        "| recovery path | seconds | steps of ddp_ft |",
        "| --- | --- | --- |",
        f"| whole-job restart, `lite run --max-restarts 1`: death to training again | {whole:.2f} | {whole / ft_step:.0f} |",
        f"| elastic scale-down, `lite run --nnodes 1:2`: a node killed to the survivor training alone (no load) |"
        f" {scale_down:.2f} | {scale_down / ft_step:.0f} |",
        f"| the same, the rendezvous's keep-alive every 1 s instead of 5 (`--rdzv-conf keep_alive_interval=1`) |"
        f" {scale_down_fast:.2f} | {scale_down_fast / ft_step:.0f} |",
        f"| ddp_ft: group killed to the survivor's next committed step | {drop:.2f} | {drop / ft_step:.0f} |",
        f"| ddp_ft: restarted group's process start to its first committed step | {heal_total:.2f} | {heal_total / ft_step:.0f} |",
        f"| diloco: group killed half-way through an interval to the survivor's next sync | {lost_s:.2f} | {lost_s / ft_step:.0f} |",
        f"| diloco: inner steps the killed group lost | {lost_steps} | |",
    ]
    write_results("regions", rows)
    (HERE / "results" / "regions.json").write_text(json.dumps(recovery, indent=1) + "\n")


if __name__ == "__main__":
    main()

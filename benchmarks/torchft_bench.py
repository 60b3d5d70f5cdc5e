"""ddp_ft (lite-torchft) against ddp, and what a failure costs; run in the test-torchft environment:

    hatch run test-torchft:python benchmarks/torchft_bench.py [--steps 60] [--repeats 3]

Rows (written to benchmarks/results/torchft.md):

- steady step: median seconds per step of 2 replica groups of 1 process under `ddp_ft` against
  2 processes under `ddp` and against 2 groups of plain torchft (a hand-written loop on torchft's
  `Manager`, `DistributedDataParallel` and `Optimizer`, no Lite; the same lighthouse), the same
  tiny model and batch per process, alternated, as ratios; with the Manager's calls per step (a
  quorum, one all-reduce, one commit vote) and the median time of each, for ddp_ft and torchft;
  and ddp_ft against torchft with one group alone (no peer to wait for);
- drop: seconds from SIGKILL of group 1 to group 0's next committed step (lighthouse
  heartbeat timeout 1 s, as `lite run --replica-groups` sets it);
- heal: seconds from the restarted group's process start to its first committed step (its
  Python start-up and imports included), and that first step's own time (quorum + healing).
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

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_ft_worker.py"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def _group(out: Path, group: int, lighthouse: str, steps: int, sleep: float,
           strategy: str = "ddp_ft", hidden: int = 64) -> subprocess.Popen[bytes]:
    env = _env(REPLICA_GROUP_ID=str(group), NUM_REPLICA_GROUPS="2", TORCHFT_LIGHTHOUSE=lighthouse,
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()), FT_HIDDEN=str(hidden))
    return subprocess.Popen([sys.executable, str(WORKER), str(out), strategy, str(steps), str(sleep)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _records(path: Path) -> tuple[dict[str, float], list[tuple[int, int, float]]]:
    """The worker's marks (`start`, `loop`) and its (step, committed, time) lines."""
    lines = [line.split() for line in path.read_text().split("\n") if line] if path.exists() else []
    marks = {line[0]: float(line[1]) for line in lines if len(line) == 2}
    return marks, [(int(a), int(b), float(c)) for a, b, c in (line for line in lines if len(line) == 3)]


def _record_of(out: Path, prefix: str, pid: int | None = None) -> Path:
    found = sorted(out.glob(f"steps-{prefix}-{pid if pid else '*'}"))
    return found[0]


def _median_step(path: Path) -> float:
    times = [t for _, _, t in _records(path)[1]]
    return statistics.median(b - a for a, b in zip(times[10:], times[11:]))


def _replica_groups(lighthouse: str, steps: int, strategy: str,
                    groups: int = 2) -> tuple[float, dict[str, tuple[float, float]]]:
    """Group 0's median step of `groups` groups under `strategy` (ddp_ft or torchft), and its calls."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        groups = [_group(out, g, lighthouse, steps, 0.0, strategy) for g in range(groups)]
        for proc in groups:
            proc.wait(timeout=300)
        step = _median_step(_record_of(out, "0"))
        calls = json.loads(next(out.glob("calls-0-*.json")).read_text())
        committed = _records(_record_of(out, "0"))[1][-1][1]
    # calls per committed step, and the median call (the first quorum, which waits for the other
    # group to start, left out)
    return step, {name: (len(times) / committed, statistics.median(times[1:])) for name, times in calls.items()
                  if name != "bytes"}


def steady(lighthouse: str, steps: int) -> tuple[float, float, float, dict, dict]:
    ft, calls = _replica_groups(lighthouse, steps, "ddp_ft")
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        subprocess.run([sys.executable, str(WORKER), str(out), "ddp", str(steps), "0"], env=_env(), check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
        plain_ddp = min(_median_step(path) for path in out.glob("steps-ddp-*"))
    plain_ft, plain_calls = _replica_groups(lighthouse, steps, "torchft")
    return ft, plain_ddp, plain_ft, calls, plain_calls


def alone(lighthouse: str, steps: int) -> tuple[float, float]:
    """One group alone (no peer to wait for at the quorum and all-reduce): ddp_ft's step and
    plain torchft's, which isolates what Lite adds in the process from the groups' rendezvous."""
    return _replica_groups(lighthouse, steps, "ddp_ft", 1)[0], _replica_groups(lighthouse, steps, "torchft", 1)[0]


def failure(lighthouse: str, steps: int = 120, kill_after: int = 10, hidden: int = 64) -> tuple[float, float, float]:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        group0, group1 = (_group(out, g, lighthouse, steps, 0.05, hidden=hidden) for g in (0, 1))
        while len(_records(_record_of_when(out, "1", group1.pid))[1]) < kill_after:
            time.sleep(0.02)
        committed_at_kill = _records(_record_of(out, "0"))[1][-1][1]
        killed = time.time()
        os.kill(group1.pid, signal.SIGKILL)
        group1.wait()
        restarted = _group(out, 1, lighthouse, steps, 0.05, hidden=hidden)
        group0.wait(timeout=300)
        restarted.wait(timeout=300)
        after = [t for _, committed, t in _records(_record_of(out, "0"))[1] if committed > committed_at_kill and t > killed]
        marks, steps = _records(_record_of(out, "1", restarted.pid))
        first_commit = steps[0][2]
        return after[0] - killed, first_commit - marks["start"], first_commit - marks["loop"]


def _record_of_when(out: Path, prefix: str, pid: int) -> Path:
    while not (out / f"steps-{prefix}-{pid}").exists():
        time.sleep(0.02)
    return out / f"steps-{prefix}-{pid}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--heal-sizes", default="",
                        help="MB of model state, comma-separated (e.g. 10,100,1000): only the heal time against the"
                             " state's size (written to results/torchft_heal.md), nothing else")
    options = parser.parse_args()
    if options.heal_sizes:
        return heal_by_size([float(mb) for mb in options.heal_sizes.split(",")])
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=1000)
    lighthouse = f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"
    ft_steps, ddp_steps, torchft_steps, calls, plain_calls, alone_ratios = [], [], [], {}, {}, []
    for _ in range(options.repeats):
        ft, plain_ddp, plain_ft, calls, plain_calls = steady(lighthouse, options.steps)
        ft_steps.append(ft)
        ddp_steps.append(plain_ddp)
        torchft_steps.append(plain_ft)
        ft_alone, torchft_alone = alone(lighthouse, options.steps)
        alone_ratios.append(ft_alone / torchft_alone)
    drop, heal_total, heal_step = failure(lighthouse)
    server.shutdown()
    ft, ddp, torchft = (statistics.median(steps) for steps in (ft_steps, ddp_steps, torchft_steps))

    def per_step(found: dict) -> str:
        return ", ".join(f"{k} {n:.2f}" for k, (n, _) in found.items())

    def median_call(found: dict) -> str:
        return ", ".join(f"{k} {t * 1e3:.2f} ms" for k, (_, t) in found.items())

    rows = [
        "| measurement | value |",
        "| --- | --- |",
        f"| steady step, ddp_ft (2 groups x 1 process) | {ft * 1e3:.2f} ms |",
        f"| steady step, plain torchft (2 groups x 1 process, no Lite) | {torchft * 1e3:.2f} ms |",
        f"| steady step, ddp (2 processes) | {ddp * 1e3:.2f} ms |",
        f"| ratio ddp_ft / torchft | {ft / torchft:.2f} |",
        f"| ratio ddp_ft / torchft, each repeat | {', '.join(f'{a / b:.2f}' for a, b in zip(ft_steps, torchft_steps))} |",
        f"| ratio ddp_ft / torchft, one group alone, each repeat | {', '.join(f'{r:.2f}' for r in alone_ratios)} |",
        f"| ratio ddp_ft / ddp | {ft / ddp:.2f} |",
        f"| ratio torchft / ddp | {torchft / ddp:.2f} |",
        f"| Manager calls per step, ddp_ft | {per_step(calls)} |",
        f"| Manager calls per step, torchft | {per_step(plain_calls)} |",
        f"| median call, ddp_ft (of the last repeat) | {median_call(calls)} |",
        f"| median call, torchft (of the last repeat) | {median_call(plain_calls)} |",
        f"| group 1 killed -> group 0's next committed step | {drop:.2f} s |",
        f"| restarted group: process start -> first committed step | {heal_total:.2f} s |",
        f"| restarted group: its first step (quorum + healing from a peer) | {heal_step:.2f} s |",
    ]
    write_results("torchft", rows)


def heal_by_size(sizes_mb: list[float]) -> None:
    """A restarted group's first step (its quorum and the heal: the peer's state sent over
    torchft's HTTP transport on loopback and loaded) against the size of that state."""
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=1000)
    lighthouse = f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"
    rows = ["| model state | parameters | process start -> first committed step | first step (quorum + heal) |",
            "| ---: | ---: | ---: | ---: |"]
    try:
        for mb in sizes_mb:
            hidden = max(1, round(mb * 2**20 / 4 / 34))  # (32 + 1 + 1) * hidden + 1 float32 parameters
            _, heal_total, heal_step = failure(lighthouse, steps=24, kill_after=4, hidden=hidden)
            rows.append(f"| {mb:g} MB | {34 * hidden + 1:,} | {heal_total:.2f} s | {heal_step:.2f} s |")
            print(rows[-1], flush=True)
    finally:
        server.shutdown()
    write_results("torchft_heal", rows)


def write_results(name: str, rows: list[str]) -> str:
    """Print the table of `rows` and write it to results/NAME.md; returns the table."""
    table = "\n".join(rows)
    print(table)
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    (results / f"{name}.md").write_text(table + "\n")
    return table


if __name__ == "__main__":
    main()

"""Goodput: the fraction of a job's time that trains, for each recovery path, at a chosen scale.

    python benchmarks/goodput.py [--failures-per-hour 1] [--step 1.0] [--checkpoint-every 30] ...

The recovery times come from `results/regions.json` (`regions_bench.py`, measured on loopback with
a tiny model: a lower bound for a large job, whose processes take longer to start, meet and load);
each can be overridden. The model (docs/regions.md, "Which recovery path"), for F failures per
hour anywhere in the job, a checkpoint every T seconds that stalls training C seconds, and a load
of L seconds:

    goodput = 1 - C / T - F * lost / 3600

where `lost` is what one failure costs, in seconds of the whole job not training:

- whole-job restart from the last checkpoint (`lite run --max-restarts`): R + L + T / 2, the
  restart, the load, and on average half a checkpoint interval trained again;
- elastic scale-down (`lite run --nnodes MIN:MAX`): E + L + T / 2, the same with the survivors'
  restart at the smaller size (E) instead; no replacement is waited for, but taking a node back in
  later restarts the workers again and costs as much once more;
- `ddp_ft` (G replica groups, per-step replication): D + S / G, every group held for the drop
  (D), and one group's share of the job missing while its replacement starts and heals (S);
- `diloco` (G groups, a sync every H steps of s seconds): D + (S + H * s + H * s / 2) / G, the
  drop at the next sync, and one group's share missing while its replacement starts, trains
  alone until the first sync it meets (up to H steps, thrown away when it heals), and the inner
  steps it had trained since its last sync (H / 2 on average).

A replacement machine is assumed ready (hot spares); add the wait for one to S, or to R for a
whole-job restart that needs every node back.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "regions.json"


@dataclass(frozen=True)
class Scale:
    failures_per_hour: float
    step_s: float
    checkpoint_every_s: float
    checkpoint_stall_s: float
    load_s: float
    groups: int
    sync_every: int


@dataclass(frozen=True)
class Recovery:
    restart_s: float  # R: a worker's death to every worker training again (no load)
    elastic_s: float  # E: a node's death to the survivors training again at the smaller size (no load)
    drop_s: float  # D: a group's death to the survivors' next committed step
    heal_s: float  # S: a replacement group's process start to its first committed step


def lost_per_failure(path: str, scale: Scale, recovery: Recovery) -> float:
    """Seconds of the whole job not training, for one failure, under `path`."""
    if path == "restart":
        return recovery.restart_s + scale.load_s + scale.checkpoint_every_s / 2
    if path == "elastic":
        return recovery.elastic_s + scale.load_s + scale.checkpoint_every_s / 2
    if path == "ddp_ft":
        return recovery.drop_s + recovery.heal_s / scale.groups
    if path == "diloco":
        interval = scale.sync_every * scale.step_s
        return recovery.drop_s + (recovery.heal_s + interval + interval / 2) / scale.groups
    raise ValueError(f"unknown recovery path {path!r}: pass 'restart', 'elastic', 'ddp_ft' or 'diloco'")


def goodput(path: str, scale: Scale, recovery: Recovery) -> float:
    """The fraction of the job's time that trains (the formula in the module docstring; 0 where
    failures come faster than the job recovers)."""
    checkpoints = scale.checkpoint_stall_s / scale.checkpoint_every_s
    return max(0.0, 1 - checkpoints - scale.failures_per_hour * lost_per_failure(path, scale, recovery) / 3600)


def best_checkpoint_interval(scale: Scale) -> float:
    """The checkpoint interval that maximises a whole-job restart's goodput: sqrt(2 C 3600 / F)
    (Young's), from d/dT of C / T + F T / 7200."""
    return math.sqrt(2 * scale.checkpoint_stall_s * 3600 / scale.failures_per_hour)


def main() -> None:
    measured = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--failures-per-hour", type=float, default=1.0, help="failures anywhere in the job")
    parser.add_argument("--step", type=float, default=1.0, help="seconds per training step at scale")
    parser.add_argument("--checkpoint-every", type=float, default=30.0, help="minutes between checkpoints")
    parser.add_argument("--checkpoint-stall", type=float, default=10.0, help="seconds a checkpoint stalls training")
    parser.add_argument("--load", type=float, default=60.0, help="seconds to load a checkpoint")
    parser.add_argument("--groups", type=int, default=8, help="replica groups (ddp_ft, diloco)")
    parser.add_argument("--sync-every", type=int, default=100, help="DiLoCo's H")
    parser.add_argument("--restart", type=float, default=measured.get("restart_s"), help="R, seconds")
    parser.add_argument("--elastic", type=float, default=measured.get("elastic_s"), help="E, seconds")
    parser.add_argument("--drop", type=float, default=measured.get("ddp_ft_drop_s"), help="D, seconds")
    parser.add_argument("--heal", type=float, default=measured.get("ddp_ft_heal_s"), help="S, seconds")
    options = parser.parse_args()
    if None in (options.restart, options.elastic, options.drop, options.heal):
        parser.error(f"no measured recovery times in {RESULTS}: run regions_bench.py, or pass --restart, --elastic,"
                     " --drop and --heal")
    scale = Scale(options.failures_per_hour, options.step, options.checkpoint_every * 60, options.checkpoint_stall,
                  options.load, options.groups, options.sync_every)
    recovery = Recovery(options.restart, options.elastic, options.drop, options.heal)
    print(f"F = {scale.failures_per_hour:g}/h, step {scale.step_s:g} s, checkpoint every {options.checkpoint_every:g} min"
          f" (stall {scale.checkpoint_stall_s:g} s, load {scale.load_s:g} s), G = {scale.groups}, H = {scale.sync_every};"
          f" R = {recovery.restart_s:.2f} s, E = {recovery.elastic_s:.2f} s, D = {recovery.drop_s:.2f} s, S = {recovery.heal_s:.2f} s\n")
    print("| recovery path | lost per failure | goodput |")
    print("| --- | --- | --- |")
    for path in ("restart", "elastic", "ddp_ft", "diloco"):
        print(f"| {path} | {lost_per_failure(path, scale, recovery):.1f} s | {goodput(path, scale, recovery):.4f} |")
    best = replace(scale, checkpoint_every_s=best_checkpoint_interval(scale))
    print(f"| restart, checkpoint every {best.checkpoint_every_s / 60:.1f} min (the best interval) |"
          f" {lost_per_failure('restart', best, recovery):.1f} s | {goodput('restart', best, recovery):.4f} |")


if __name__ == "__main__":
    main()

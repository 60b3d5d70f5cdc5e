"""The chaos soak: the chaos job of packages/lite-torchft/tests/_chaos.py under a longer schedule.

    python benchmarks/chaos_soak.py [--faults 6] [--seed 0] [--runs 1] [--strategy ddp_ft|diloco]

Starts its own torchft lighthouse, moto S3 server and MLflow tracking server on 127.0.0.1 (the job
streams its data from the S3 server and logs to MLflow, trackio and W&B offline), runs the job once without
faults (the baseline, same machine, same invocation) and then `--runs` times under the seeded
schedule of `--faults` faults (seeds S, S+1, ...), checking each run as the CI test does. Prints one
row per run: the faults injected, the steps trained again after a rollback to the last checkpoint,
the samples trained more than once in an epoch (must be 0), the measured goodput (the baseline's
seconds over the run's: the fraction of the faulted run that trained) and the goodput modelled by
docs/regions.md's formula from the recovery times measured on this machine (`--restart`,
`--drop`, `--heal`: R, D and S of that page's table) and this run's checkpoint interval (every
step, so T / 2 is half a step):

    modelled = base / (base + sum of lost per fault),
    lost = R + load for kill-job, preempt-job and store-down; D + S / 2 for kill-group; 0 for slow-group
           and tracker-down (training goes on; the harness holds both groups while the MLflow
           server starts again, which the measured figure counts)

`--strategy diloco` runs the job's second configuration (`DiLoCoStrategy(sync_every=4)`, each
run's weights checked against the one-process simulation of what happened; see _chaos.py), the
baseline too.

The job is tiny (a 3-8-1 network, 24 steps), so process starts and quorums dominate both
figures: they show that no fault loses more than the model says, not a large job's numbers.
Needs the `test-torchft` environment (torchft, s3fs, moto, datasets, mlflow, wandb): `hatch run test-torchft:python
benchmarks/chaos_soak.py`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository's conftest.py: free_port, script_env, S3Server


def _harness():
    spec = importlib.util.spec_from_file_location("_chaos", ROOT / "packages/lite-torchft/tests/_chaos.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["_chaos"] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _modelled(chaos, schedule, base: float, options: argparse.Namespace) -> float:
    lost = 0.0
    for fault in schedule:
        if fault.kind in ("kill-job", "preempt-job", "store-down"):
            lost += options.restart + options.load
        elif fault.kind == "kill-group":
            lost += options.drop + options.heal / 2
    return base / (base + lost)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--strategy", choices=("ddp_ft", "diloco"), default="ddp_ft",
                        help="the job's configuration (tests/_chaos.py CONFIGS)")
    parser.add_argument("--restart", type=float, default=2.84, help="R, seconds (docs/regions.md)")
    parser.add_argument("--drop", type=float, default=1.00, help="D, seconds (docs/regions.md)")
    parser.add_argument("--heal", type=float, default=1.16, help="S, seconds (docs/regions.md)")
    parser.add_argument("--load", type=float, default=0.5, help="L, seconds to load the tiny checkpoint")
    options = parser.parse_args()

    import logging

    import conftest
    import moto.settings
    from torchft._torchft import LighthouseServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's server logs every request
    chaos = _harness()
    chaos.PATIENCE = 300.0
    moto.settings.INITIAL_NO_AUTH_ACTION_COUNT = float("inf")
    server = conftest.S3Server()
    server.start()
    os.environ.update(server.env)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=1000)
    address = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    mlflow = None
    try:
        with tempfile.TemporaryDirectory() as folder:
            (Path(folder) / "mlflow").mkdir()
            mlflow = chaos.MLflowServer(Path(folder) / "mlflow", conftest.free_port())
            mlflow.start()

            def one(name: str, schedule):
                out = Path(folder) / name
                out.mkdir()
                bucket = f"s3://{server.new_bucket()}/chaos"
                try:
                    return chaos.run(out, address, bucket, server, conftest.script_env, conftest.free_port,
                                     schedule, mlflow, options.strategy)
                except BaseException:  # keep what the failed run wrote (ledgers, events, logs) to read
                    kept = Path(tempfile.mkdtemp(prefix=f"chaos-soak-{name}-"))
                    shutil.copytree(out, kept, dirs_exist_ok=True)
                    print(f"the run's folder is kept in {kept}", flush=True)
                    raise

            base = one("baseline", []).seconds
            print(f"baseline ({options.strategy}, no fault): {base:.1f} s for {chaos.STEPS} steps")
            print("| seed | faults | steps trained again | samples repeated | samples skipped by a heal | seconds |"
                  " goodput measured | modelled |")
            print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
            for seed in range(options.seed, options.seed + options.runs):
                schedule = chaos.draw(seed, options.faults)
                started = time.monotonic()
                report = one(f"seed-{seed}", schedule)
                seconds = time.monotonic() - started
                kinds = ", ".join(fault.kind for fault in schedule)
                print(f"| {seed} | {kinds} | {report.steps_trained_again} | {report.samples_repeated} | {report.samples_skipped} |"
                      f" {seconds:.1f} | {base / seconds:.2f} | {_modelled(chaos, schedule, base, options):.2f} |",
                      flush=True)
    finally:
        if mlflow is not None:
            mlflow.stop()
        lighthouse.shutdown()
        server.stop()


if __name__ == "__main__":
    main()

"""Expert parallelism through Lite against the same job written by hand, on 2 processes.

    python benchmarks/expert_parallel.py [--quick] [--results-dir DIR]
    python benchmarks/expert_parallel.py --device cuda --out DIR/gpu_expert_parallel   # NCCL, bf16, grouped_mm

Runs `_ep_worker.py` (2 processes; gloo on CPU, NCCL on a GPU): a 2-layer top-2 Mixture-of-Experts
trained with Lite's `ExpertParallel` under `ModelParallelStrategy` (`lite`), with the same job
written by hand from torch's APIs (`plain`: its own `DeviceMesh`, `distribute_tensor`, a dispatch
on `all_to_all_single_autograd`, FSDP2 `fully_shard`) and with a second hand-written copy
(`control`, the A/A noise floor). The worker first checks that the arms' losses and weights agree
(exit 3 otherwise), then times them in interleaved blocks, rotating their order every round.

Reported as `run.py` reports its rows: the median step of each arm, median(Lite) / median(plain)
with a paired bootstrap 95% interval, the A/A ratio, the goal (1.02) and a verdict; plus the
Python calls per step of each arm (deterministic). Written to `RESULTS_DIR/expert_parallel.md` and
`.json` (default `benchmarks/results/`), or to `--out` + `.md`/`.json`. Exit 1 when the worker
fails (a mismatch included).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import bootstrap_ratio_ci, ratio_of_medians  # noqa: E402
from run import BenchmarkError, Row, child_env, render_table, run_child, step_rows  # noqa: E402

TARGET = 1.02
#: Worker arguments: (rounds, timed steps per block, warm-up steps) per mode.
PLANS = {"quick": ("4", "3", "2"), "full": ("20", "6", "4"), "smoke": ("2", "2", "1")}
#: The model per device: a CPU step of tens of milliseconds; on a GPU bf16 and grouped_mm, larger.
SHAPES = {"cpu": ["--hidden", "256", "--ffn", "512", "--tokens", "128"],
          "cuda": ["--hidden", "1024", "--ffn", "2048", "--tokens", "4096", "--dtype", "bfloat16", "--grouped"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short run (about a minute on 2 CPUs)")
    parser.add_argument("--smoke", action="store_true", help="the shortest run: checks that it works, times little")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--gpu-style", action="store_true",
                        help="on the CPU, the GPU's model in small: bf16 and torch._grouped_mm (to test that path)")
    parser.add_argument("--results-dir", type=Path, default=HERE / "results", help="where expert_parallel.md/json go")
    parser.add_argument("--out", default=None, help="instead: write OUT.md and OUT.json")
    parser.add_argument("--timeout", type=float, default=540, help="seconds before the worker is killed")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    reps, steps, warmup = PLANS[mode]
    shape = SHAPES[args.device]
    if args.gpu_style and args.device == "cpu":
        shape = ["--hidden", "128", "--ffn", "256", "--tokens", "128", "--dtype", "bfloat16", "--grouped"]
    if args.device == "cuda":
        import torch

        if torch.cuda.is_available() and torch.cuda.get_device_capability(0) < (9, 0):
            shape = [arg for arg in shape if arg != "--grouped"]  # grouped_mm wants sm90+: the loop instead
            print("expert parallel: below compute capability 9.0, the experts loop instead of torch._grouped_mm")
    load_at_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="lite-bench-ep-") as workdir:
        out = Path(workdir) / "ep.json"
        command = [sys.executable, str(HERE / "_ep_worker.py"), "--device", args.device, "--out", str(out),
                   "--reps", reps, "--steps", steps, "--warmup", warmup, "--control", "--calls", "--cpu-time", *shape]
        if mode == "smoke":
            command += ["--check-steps", "2"]
        try:
            wall_s, stdout, stderr = run_child(command, args.timeout, child_env(1))
        except BenchmarkError as err:
            print(f"expert parallel: FAILED: {err}", file=sys.stderr)
            return 1
        result = json.loads(out.read_text())
    data = result["models"]["moe"]
    rows = step_rows(result, "ep", f"Step, 2-proc expert parallel ({result['device']}), rank 0")
    for row in rows:
        row.target = TARGET
    cpu = {name: [v / 1e3 for v in values] for name, values in data["cpu_ns_per_step"].items()}
    cpu_row = Row("ep-cpu:moe", "CPU time per step of rank 0 (process_time; waits for the other rank excluded)",
                  "µs/step", plain=statistics.median(cpu["plain"]), lite=statistics.median(cpu["lite"]),
                  ratio=ratio_of_medians(cpu["plain"], cpu["lite"]), ci=bootstrap_ratio_ci(cpu["plain"], cpu["lite"]),
                  control=ratio_of_medians(cpu["plain"], cpu["control"]), target=TARGET, reps=len(cpu["plain"]))
    cpu_row.note = f"{cpu_row.lite - cpu_row.plain:+.1f} µs/step; {data['reps']}x{data['steps_per_block']} steps per arm"
    rows.append(cpu_row)
    calls = data["calls_per_step"]
    rows.append(Row("ep-calls:moe", "Calls per step (deterministic, sys.setprofile), rank 0", "calls",
                    plain=calls["plain"], lite=calls["lite"], ratio=calls["lite"] / calls["plain"],
                    note=f"{calls['lite'] - calls['plain']:+.0f} calls/step", reps=10))
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=HERE, capture_output=True, text=True,
                            timeout=30).stdout.strip()
    import torch

    info = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "mode": mode,
            "device": result["device"], "ranks_share_device_0": result["ranks_share_device_0"],
            "python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "load_average_start": load_at_start, "load_average_end": os.getloadavg(), "git_commit": commit or None,
            "worker_wall_s": wall_s}
    check = data["check"]
    blocks = data["block_medians_ns"]
    # Each round runs every arm once, back to back: the median of the per-round ratios is steadier
    # when the machine's load changes between rounds (as pipeline.py reports it).
    paired = {name: statistics.median(b / a for a, b in zip(blocks["plain"], blocks[name])) for name in ("lite", "control")}
    info["paired_median_ratio"] = paired
    info["lite_core"] = result.get("lite_core")
    extra = ", ".join(f"{name} x{count:g}" for name, count in list(data["extra_lite_calls_per_step"].items())[:12])
    report = "\n".join([
        f"# Expert parallelism: Lite vs by hand ({mode} run, {info['date']})", "",
        f"{data['description']}. torch {info['torch']}, {info['cpus']} CPUs, 1 torch thread per process, load average"
        f" {', '.join(f'{v:.2f}' for v in load_at_start)} at start / {', '.join(f'{v:.2f}' for v in info['load_average_end'])}"
        f" at end, commit {info['git_commit']}, lite_core from {info['lite_core']}.", "",
        render_table(rows), "",
        f"- Before timing, {len(check['losses'])} steps of every arm on the same batches: largest loss difference Lite"
        f" vs by hand {check['lite_max_loss_difference']:.1e}, weights {check['lite_max_weight_difference']:.1e}"
        f" (tolerance {data['tolerance']:g}).",
        "- Ratio = median(Lite) / median(by hand) of the per-block median step; 95% CI = paired bootstrap; A/A = a"
        " second hand-written arm / the first.",
        f"- Largest extra calls in one Lite step: {extra}.", ""])
    print(report)
    if args.out:
        md, js = Path(f"{args.out}.md"), Path(f"{args.out}.json")
        md.parent.mkdir(parents=True, exist_ok=True)
    else:
        args.results_dir.mkdir(parents=True, exist_ok=True)
        md, js = args.results_dir / "expert_parallel.md", args.results_dir / "expert_parallel.json"
    md.write_text(report, encoding="utf-8")
    payload = {"info": info, "rows": [{**asdict(row), "verdict": row.verdict} for row in rows], "check": check,
               "block_medians_ns": data["block_medians_ns"], "calls_per_step": calls,
               "extra_lite_calls_per_step": data["extra_lite_calls_per_step"]}
    js.write_text(json.dumps(payload, indent=2), encoding="utf-8")
    ratio = rows[0].ratio
    print(f"expert parallel ({result['device']}, {mode}): Lite / by hand {ratio:.3f}"
          f" (95% CI {rows[0].ci[0]:.3f}-{rows[0].ci[1]:.3f}, A/A {rows[0].control:.3f}; per-round median"
          f" {paired['lite']:.3f}, A/A {paired['control']:.3f}), losses equal: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`measure_flops` counts what the analytic formula says; `ThroughputMonitor` reports rates over
its window, divides per-device numbers by the data-parallel size, leaves MFU out where no peak
is known, logs to Lite's loggers, and refuses bad input in one sentence."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

import lite_core
import lite_core.monitor
from lite_core import LightningLite, ThroughputMonitor, measure_flops
from lite_core.accelerators.cpu import CPUAccelerator
from lite_core.errors import ConfigurationError, MisuseError

BATCH, IN, HIDDEN, OUT = 8, 16, 32, 4


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def _forward_flops() -> int:
    return 2 * BATCH * IN * HIDDEN + 2 * BATCH * HIDDEN * OUT  # 2 * batch * in * out per Linear


def test_the_flops_of_a_small_mlp_equal_the_analytic_count() -> None:
    model = _mlp()
    x = torch.randn(BATCH, IN)
    assert measure_flops(model, x, backward=False) == _forward_flops()
    # With backward: x3 (the gradient of each Linear's input and of its weight cost one forward
    # each); the input must want its gradient for the first Linear to pay for its input gradient.
    assert measure_flops(model, x.requires_grad_()) == 3 * _forward_flops()
    # The first layer's input gradient is skipped when the input needs none, as torch does.
    assert measure_flops(model, torch.randn(BATCH, IN)) == 3 * _forward_flops() - 2 * BATCH * IN * HIDDEN


def test_measuring_on_the_meta_device_leaves_the_model_untouched() -> None:
    model = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert measure_flops(model, torch.randn(BATCH, IN), on_meta=True) > 0
    assert all(p.grad is None and p.device.type == "cpu" for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    lite = LightningLite(accelerator="cpu")
    assert measure_flops(lite.setup(_mlp()), torch.randn(BATCH, IN), backward=False) == _forward_flops()


class RecordingLogger:
    def __init__(self) -> None:
        self.logged: list[tuple[dict[str, float], int | None]] = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((metrics, step))


class KnownPeakCPU(CPUAccelerator):
    def peak_flops(self, device: torch.device, dtype: str) -> float | None:
        return {"fp32": 1e9, "tf32": 2e9}.get(dtype)


def _run_steps(monitor: ThroughputMonitor, steps: int, seconds: float, batch: int = 4, items: int = 40) -> None:
    for _ in range(steps):
        time.sleep(seconds)
        monitor.step(batch_size=batch, items=items)


def test_rates_mfu_and_logging_over_the_window() -> None:
    logger = RecordingLogger()
    lite = LightningLite(accelerator=KnownPeakCPU(), loggers=logger)
    monitor = ThroughputMonitor(lite, window=4, flops_per_step=1e7, log_every_n_steps=5)
    _run_steps(monitor, 5, 0.02)
    [(metrics, step)] = logger.logged
    assert step == 5
    rate = metrics["throughput/samples_per_sec"]
    assert 4 / 0.04 < rate < 4 / 0.02 * 1.01  # 4 samples every 20 ms (plus the sleep's own overshoot)
    assert metrics["throughput/items_per_sec"] == pytest.approx(10 * rate)
    assert metrics["throughput/batches_per_sec"] == pytest.approx(rate / 4)
    assert metrics["throughput/device/samples_per_sec"] == pytest.approx(rate)  # one replica
    flops = metrics["throughput/flops_per_sec"]
    assert flops == pytest.approx(1e7 * rate / 4)
    assert metrics["throughput/mfu"] == pytest.approx(flops / 1e9)  # fp32: torch's default matmul precision
    assert metrics["memory/peak_bytes"] > 10 * 2**20  # this process's peak RSS
    assert 0 <= metrics["throughput/data_wait_fraction"] <= 1


def test_per_device_numbers_divide_by_the_data_parallel_size_not_the_world_size(monkeypatch) -> None:
    lite = LightningLite(accelerator=KnownPeakCPU())
    monkeypatch.setattr(type(lite.strategy), "distributed_sampler_kwargs", lambda self: {"num_replicas": 2, "rank": 0})
    monkeypatch.setattr(type(lite.strategy), "world_size", property(lambda self: 4))  # 2-way data x 2-way model parallel
    monitor = ThroughputMonitor(lite, flops_per_step=1e6, log_every_n_steps=0)
    _run_steps(monitor, 3, 0.01)
    metrics = monitor.compute()
    assert metrics["throughput/samples_per_sec"] == pytest.approx(2 * metrics["throughput/device/samples_per_sec"])
    assert metrics["throughput/flops_per_sec"] == pytest.approx(4 * metrics["throughput/device/flops_per_sec"])
    assert metrics["throughput/mfu"] == pytest.approx(metrics["throughput/flops_per_sec"] / (4 * 1e9))


def test_without_a_known_peak_mfu_is_left_out_and_a_user_peak_brings_it_back() -> None:
    lite = LightningLite(accelerator="cpu")
    monitor = ThroughputMonitor(lite, flops_per_step=1e6, log_every_n_steps=0)
    assert monitor.peak_flops is None
    _run_steps(monitor, 3, 0.001)
    assert "throughput/flops_per_sec" in monitor.compute() and "throughput/mfu" not in monitor.compute()
    given = ThroughputMonitor(lite, flops_per_step=1e6, peak_flops=5e9, log_every_n_steps=0)
    _run_steps(given, 3, 0.001)
    assert given.compute()["throughput/mfu"] == pytest.approx(given.compute()["throughput/flops_per_sec"] / 5e9)


def test_the_peak_follows_the_precision_and_torch_matmul_precision() -> None:
    lite = LightningLite(accelerator=KnownPeakCPU())
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert ThroughputMonitor(lite).peak_flops == 2e9
    finally:
        torch.set_float32_matmul_precision(previous)
    assert ThroughputMonitor(lite).peak_flops == 1e9
    assert ThroughputMonitor(lite, dtype="bf16").peak_flops is None


def test_data_wait_fraction_counts_the_time_batches_take_to_arrive() -> None:
    monitor = ThroughputMonitor(LightningLite(accelerator="cpu"), log_every_n_steps=0)

    def slow_loader() -> Any:
        for _ in range(4):
            time.sleep(0.03)
            yield torch.ones(2)

    for _ in monitor.timed(slow_loader()):
        time.sleep(0.01)
        monitor.step(batch_size=2)
    assert 0.5 < monitor.compute()["throughput/data_wait_fraction"] <= 1.0  # 30 of every 40 ms


def test_the_progress_bar_shows_the_rate_and_mfu() -> None:
    class Bar:
        postfix: dict[str, str] = {}

        def set_postfix(self, postfix: dict[str, str], refresh: bool = True) -> None:
            Bar.postfix = postfix

    monitor = ThroughputMonitor(LightningLite(accelerator="cpu"), flops_per_step=1e6, peak_flops=1e9,
                                log_every_n_steps=3, progress_bar=Bar())
    _run_steps(monitor, 3, 0.001)
    assert set(Bar.postfix) == {"samples/s", "MFU"}


def test_under_gradient_accumulation_the_rows_follow_the_optimizer_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop accumulating 3 micro-batches per optimizer step logs its loss at the optimizer step; the
    monitor, told that step, logs at steps 2 and 4 once each, never at a micro-batch count."""
    ticks = iter(range(1000))
    monkeypatch.setattr(lite_core.monitor, "_clock", lambda: float(next(ticks)))  # one second per batch
    logger = RecordingLogger()
    lite = LightningLite(accelerator="cpu", loggers=logger)
    monitor = ThroughputMonitor(lite, window=3, log_every_n_steps=2)
    optimizer_step = 0
    for micro_batch in range(12):
        if (micro_batch + 1) % 3 == 0:  # optimizer.step()
            optimizer_step += 1
            lite.log("loss", 1.0, step=optimizer_step)
        monitor.step(batch_size=4, step=optimizer_step)
    steps = [step for _, step in logger.logged]
    assert steps == sorted(steps), f"rows out of order: {steps}"
    assert [step for metrics, step in logger.logged if "throughput/samples_per_sec" in metrics] == [2, 4]
    rates = [m["throughput/samples_per_sec"] for m, _ in logger.logged if "throughput/samples_per_sec" in m]
    assert rates == [4.0, 4.0]  # every micro-batch counts: 4 samples a second


@pytest.mark.parametrize("step", [-1, 2.0, "3"])
def test_a_step_that_is_not_an_optimizer_step_is_one_sentence(step: Any) -> None:
    monitor = ThroughputMonitor(LightningLite(accelerator="cpu"))
    with pytest.raises(MisuseError, match=r"^ThroughputMonitor.step\(\) got step=.*: pass your optimizer step, an int"
                                          r" >= 0, or leave it out to count every call as one step\.$"):
        monitor.step(batch_size=2, step=step)


@pytest.mark.parametrize("batch_size", [0, -3, 2.5])
def test_a_non_positive_batch_size_is_one_sentence(batch_size: Any) -> None:
    monitor = ThroughputMonitor(LightningLite(accelerator="cpu"))
    with pytest.raises(MisuseError, match=r"^ThroughputMonitor.step\(\) got batch_size=.*: pass the number of samples"
                                          r" in this step's batch, a positive int\.$"):
        monitor.step(batch_size=batch_size)


@pytest.mark.parametrize("peak", [0, -1e12, float("nan"), "989e12"])
def test_a_peak_that_is_not_a_positive_number_is_one_sentence(peak: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"^peak_flops=.* is not a positive number: pass the dense peak"
                                                 r" FLOP/s of one device, e\.g\. 989e12, or None\.$"):
        ThroughputMonitor(LightningLite(accelerator="cpu"), peak_flops=peak)


def test_the_monitor_is_exported_lazily_from_the_package_root() -> None:
    assert {"ThroughputMonitor", "measure_flops"} <= set(lite_core.__all__)
    assert lite_core.ThroughputMonitor is ThroughputMonitor


def test_each_row_holds_the_checkpoints_stall_since_the_row_before(tmp_path, monkeypatch) -> None:
    from types import SimpleNamespace

    import lite_core.running._checkpoints as checkpoints

    readings = iter(range(0, 300, 3))  # each clock reading 3 s after the one before: every save stalls 3 s
    monkeypatch.setattr(checkpoints, "time", SimpleNamespace(perf_counter=lambda: float(next(readings))))
    logger = RecordingLogger()
    lite = LightningLite(accelerator="cpu", loggers=logger)
    model = lite.setup(nn.Linear(2, 2))
    monitor = ThroughputMonitor(lite, log_every_n_steps=2)
    for step in range(1, 7):
        if step in (1, 2, 5):
            lite.save({"model": model}, tmp_path / f"step-{step}.pt")
        monitor.step(batch_size=4)
    rows = [(metrics["checkpoint/stall_seconds"], metrics["checkpoint/saves"]) for metrics, _ in logger.logged]
    assert rows == [(6.0, 2.0), (0.0, 0.0), (3.0, 1.0)]
    assert lite.checkpoint_stall == (9.0, 3)


def test_rows_hold_the_restarts_under_lite_run_and_what_the_strategy_knows_of_failures(monkeypatch) -> None:
    logger = RecordingLogger()
    lite = LightningLite(accelerator="cpu", loggers=logger)
    monitor = ThroughputMonitor(lite, log_every_n_steps=2)
    for _ in range(2):
        monitor.step(batch_size=4)
    assert not any(name.startswith("fault/") for name in logger.logged[-1][0])  # not under lite run: none
    monkeypatch.setenv("LITE_RESTART_COUNT", "2")  # the third attempt of a `lite run --max-restarts` job
    monkeypatch.setattr(lite.strategy, "fault_tolerance_figures", lambda: {"fault/replica_groups": 3.0})
    for _ in range(2):
        monitor.step(batch_size=4)
    row = logger.logged[-1][0]
    assert {name: value for name, value in row.items() if name.startswith("fault/")} == {
        "fault/restarts": 2.0, "fault/replica_groups": 3.0}


def test_a_monitor_marks_the_steps_of_its_own_lites_profiler_only(tmp_path: Any) -> None:
    """The running profilers belong to the LightningLite whose profile() runs them, not to the
    process: another Lite's monitor in the same process does not step them."""
    profiled, other = LightningLite(accelerator="cpu"), LightningLite(accelerator="cpu")
    mine, theirs = ThroughputMonitor(profiled, log_every_n_steps=0), ThroughputMonitor(other, log_every_n_steps=0)
    with profiled.profile(tmp_path, wait=5, warmup=1, active=1) as prof:
        theirs.step(batch_size=1)
        assert prof.step_num == 0
        mine.step(batch_size=1)
        mine.step(batch_size=1)
        assert prof.step_num == 2
    theirs.step(batch_size=1)  # after the block: nothing to mark


# -- a Mixture-of-Experts layer: its active FLOPs ---------------------------------------------------
EXPERTS, TOP_K, TOKENS, WIDTH = 4, 2, 12, 16  # _grouped_mm on CPU: bfloat16, rows of 16-byte multiples


class _LoopExperts(nn.Module):
    """Stacked experts over tokens sorted by expert, one matrix product per expert."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(EXPERTS, WIDTH, 2 * WIDTH, generator=generator).bfloat16())
        self.w2 = nn.Parameter(torch.randn(EXPERTS, 2 * WIDTH, WIDTH, generator=generator).bfloat16())

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        chunks = torch.split(tokens, counts.tolist())
        return torch.cat([torch.tanh(chunk @ self.w1[e]) @ self.w2[e] for e, chunk in enumerate(chunks)])


class _GroupedExperts(_LoopExperts):
    """The same experts through `torch._grouped_mm`, which torch's counter does not count."""

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        return torch._grouped_mm(torch.tanh(torch._grouped_mm(tokens, self.w1, offs=offsets)), self.w2, offs=offsets)


class _TopTwoMoE(nn.Module):
    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.router = nn.Linear(WIDTH, EXPERTS, bias=False).bfloat16()
        self.experts = experts

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weights, chosen = torch.softmax(self.router(h).float(), dim=-1).topk(TOP_K, dim=-1)
        order = torch.argsort(chosen.flatten(), stable=True)
        routed = self.experts(h.repeat_interleave(TOP_K, dim=0)[order], torch.bincount(chosen.flatten(), minlength=EXPERTS))
        unsorted = torch.empty_like(routed).index_copy(0, order, routed)
        return (unsorted.view(len(h), TOP_K, WIDTH) * weights.unsqueeze(-1).bfloat16()).sum(1)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch before 2.8 has no _grouped_mm")
def test_an_moe_counts_its_active_flops_whether_its_experts_loop_or_use_grouped_mm() -> None:
    # torch's counter gives _grouped_mm 0 FLOPs: the grouped MoE counted its router alone.
    h = torch.randn(TOKENS, WIDTH, generator=torch.Generator().manual_seed(1)).bfloat16().requires_grad_()
    loop, grouped = _TopTwoMoE(_LoopExperts()), _TopTwoMoE(_GroupedExperts())
    grouped.load_state_dict(loop.state_dict())
    router = 2 * TOKENS * WIDTH * EXPERTS
    experts = 2 * TOKENS * TOP_K * (WIDTH * 2 * WIDTH + 2 * WIDTH * WIDTH)  # each token through its top 2 only
    assert measure_flops(loop, h, backward=False, on_meta=False) == router + experts
    assert measure_flops(grouped, h, backward=False, on_meta=False) == router + experts
    # Backward: each product's two gradients (the experts' weight gradients are 2-D x 2-D grouped products).
    assert measure_flops(grouped, h, on_meta=False) == measure_flops(loop, h, on_meta=False) == 3 * (router + experts)

"""Sampler injection and training parity with 2 real processes over gloo.

`tests/scripts/train.py` runs once per strategy (module-scoped cache). The parity tests replay
the same data from the same initial weights with a plain one-process PyTorch loop here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

STRATEGIES = ["ddp", "ddp_spawn", "ddp_fork"]
GLOBAL_BATCH = 8
MICRO_BATCH = 2  # per rank, as in train.py
LR = 0.1


class Job:
    def __init__(self, out_dir: Path) -> None:
        self.sampling = [json.loads((out_dir / f"sampling_rank{r}.json").read_text()) for r in (0, 1)]
        self.grads = [json.loads((out_dir / f"grads_rank{r}.json").read_text()) for r in (0, 1)]
        self.training = torch.load(out_dir / "training.pt", weights_only=True)
        self.checks = [json.loads((out_dir / f"checks_rank{r}.json").read_text()) for r in (0, 1)]

    def shards(self, case: str, epoch: int = 0) -> list[list[int]]:
        """Per rank, the flat list of indexes it saw in `epoch`."""
        return [[i for batch in record[case]["batches"][epoch] for i in batch] for record in self.sampling]

    def batches(self, case: str, rank: int, epoch: int = 0) -> list[list[int]]:
        return self.sampling[rank][case]["batches"][epoch]


@pytest.fixture(scope="module")
def training_job(run_script, output_of, tmp_path_factory):
    jobs: dict[str, Job] = {}

    def get(strategy: str) -> Job:
        if strategy not in jobs:
            out_dir = tmp_path_factory.mktemp(f"train-{strategy}")
            proc = run_script("train.py", strategy, out_dir)
            assert proc.returncode == 0, output_of(proc)
            jobs[strategy] = Job(out_dir)
        return jobs[strategy]

    return get


# -- sampler injection ---------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sequential_loader_is_sharded(strategy, training_job):
    job = training_job(strategy)
    zero, one = job.shards("sequential")
    assert zero == [0, 2, 4, 6, 8] and one == [1, 3, 5, 7, 9]
    assert job.sampling[0]["sequential"]["len"] == 3  # ceil(5 / batch_size 2)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_shuffled_loader_is_sharded_and_reshuffled_each_epoch(strategy, training_job):
    job = training_job(strategy)
    orders = []
    for epoch in (0, 1):
        zero, one = job.shards("shuffled", epoch)
        assert len(zero) == len(one) == 10
        assert not set(zero) & set(one), "the ranks' shards overlap"
        assert sorted(zero + one) == list(range(20)), "the shards do not cover the dataset"
        assert zero != sorted(zero) and one != sorted(one), "shuffle=True was not kept"
        orders.append((zero, one))
    assert orders[0] != orders[1], "the order did not change between epochs (set_epoch not called)"
    assert job.batches("shuffled", 0)[0].__len__() == 5  # batch_size kept


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_drop_last_is_kept(strategy, training_job):
    job = training_job(strategy)
    for rank in (0, 1):
        record = job.sampling[rank]["drop_last"]
        assert record["drop_last"] is True
        # 11 samples: 5 per rank after dropping the uneven tail, then the incomplete batch goes.
        assert [len(b) for b in record["batches"][0]] == [2, 2]
        assert record["len"] == 2
    zero, one = job.shards("drop_last")
    assert not set(zero) & set(one)
    # Without drop_last, every sample is seen (padded so that both ranks get 6).
    zero, one = job.shards("keep_last")
    assert len(zero) == len(one) == 6
    assert set(zero) | set(one) == set(range(11))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_custom_sampler_is_sharded(strategy, training_job):
    job = training_job(strategy)
    order = [(7 * i + 3) % 10 for i in range(10)]  # FixedPermutation(10) in train.py
    zero, one = job.shards("custom_sampler")
    assert zero == order[0::2] and one == order[1::2]
    assert sorted(zero + one) == list(range(10))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_own_distributed_sampler_is_left_alone(strategy, training_job):
    job = training_job(strategy)
    for rank in (0, 1):
        assert job.sampling[rank]["own_distributed_sampler"]["same_object"] is True
    # The user's DistributedSampler already shards; sharding it again would halve each shard.
    zero, one = job.shards("own_distributed_sampler")
    assert zero == [0, 2, 4, 6, 8] and one == [1, 3, 5, 7, 9]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dataloader_subclass_made_in_run_gets_a_distributed_sampler(strategy, training_job):
    job = training_job(strategy)
    zero, one = job.shards("custom_loader")  # MyLoader(dataset, my_arg, batch_size) in train.py
    assert zero == [0, 2, 4, 6, 8] and one == [1, 3, 5, 7, 9]
    for rank in (0, 1):
        record = job.sampling[rank]["custom_loader"]
        # Lite's sampler is a torch DistributedSampler (a subclass of it that resumes mid-epoch)
        assert "DistributedSampler" in record["sampler"] and record["my_arg"] == "mine"


# -- the code users write ---------------------------------------------------------------------------
def _one_sentence(message: str) -> None:
    assert "\n" not in message and message.endswith("."), message
    assert not re.search(r"[.!?]\s+[A-Z][a-z]", message[:-1]), f"more than one sentence: {message!r}"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_model_passed_to_setup_is_the_set_up_one_and_a_loss_that_skipped_the_strategy_fails_at_backward(
        strategy, training_job):
    for checks in training_job(strategy).checks:
        assert checks["discarded_setup"] == {"ranks_agree": True}, "the model passed to setup() trained unsynchronised"
        error = checks["forward_called_directly"]
        assert error is not None, "a loss from model.forward(x) ran backward without synchronising gradients"
        assert error["type"] == "MisuseError"
        _one_sentence(error["message"])
        assert "calling a model passed to setup() (model(x), not model.forward(x))" in error["message"]
        assert checks["retain_graph"] is None, "two backward passes through one forward were refused"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lr_schedulers_round_trip_through_a_checkpoint(strategy, training_job):
    for checks in training_job(strategy).checks:
        assert checks["schedulers"] == {"step": 2, "before_equal": True, "after_equal": True, "lrs_equal": True,
                                        "saved_as_state": True}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_shuffled_run_resumed_at_an_epoch_boundary_equals_the_uninterrupted_run(strategy, training_job):
    # The loader in the checkpoint carries its epoch: the DistributedSampler shuffles epoch 2 as the
    # uninterrupted run did (its counter restarted at 0: epoch-3 loss 0.18 against 0.10).
    for checks in training_job(strategy).checks:
        assert checks["shuffled_resume"]["max_difference"] <= 1e-6, checks["shuffled_resume"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_save_that_fails_on_rank_0_raises_on_every_rank(strategy, training_job):
    checks = training_job(strategy).checks
    for rank, record in enumerate(checks):
        error = record["failed_save"]
        assert error is not None and error["type"] == "CheckpointError", error
        _one_sentence(error["message"])
        assert "failed on rank 0 with IsADirectoryError" in error["message"]
    assert checks[0]["failed_save"]["cause"] == "IsADirectoryError"  # rank 0 chains its own error


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_write_that_fails_on_one_rank_of_several_raises_on_every_rank(strategy, training_job):
    # `lite_core.plugins.on_writing_ranks`, as a backend whose ranks each write a part uses it.
    checks = training_job(strategy).checks
    for record in checks:
        error = record["failed_part"]
        assert error is not None and error["type"] == "CheckpointError", error
        _one_sentence(error["message"])
        assert "'parts' failed on rank 1 with OSError ([Errno 28] No space left on device)" in error["message"]
    assert [record["failed_part"]["cause"] for record in checks] == [None, "OSError"]  # rank 1 chains its own


# -- parity with plain PyTorch -------------------------------------------------------------------
def plain_pytorch(x: torch.Tensor, y: torch.Tensor, initial: dict[str, Any], batch: int,
                  accumulate: int) -> tuple[dict[str, torch.Tensor], int]:
    """One process, no Lite: SGD over consecutive batches, `accumulate` batches per step."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model.load_state_dict(initial)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    batches = [(x[i:i + batch], y[i:i + batch]) for i in range(0, len(x), batch)]
    steps = 0
    for start in range(0, len(batches), accumulate):
        optimizer.zero_grad()
        for xb, yb in batches[start:start + accumulate]:
            nn.functional.mse_loss(model(xb), yb).backward()
        optimizer.step()
        steps += 1
    return model.state_dict(), steps


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ddp_training_matches_plain_pytorch(strategy, training_job, assert_weights_match):
    results = training_job(strategy).training
    assert results["plain_ranks_agree"], "the ranks ended with different weights"
    expected, steps = plain_pytorch(results["x"], results["y"], results["initial"], GLOBAL_BATCH, 1)
    assert results["plain_steps"] == steps == 4
    assert_weights_match(results["plain_final"], expected, results["initial"])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradient_accumulation_with_no_backward_sync(strategy, training_job, assert_weights_match):
    job = training_job(strategy)
    for rank in (0, 1):
        assert len(job.grads[rank]) == 4
        for step in job.grads[rank]:
            # Inside no_backward_sync the ranks keep their own gradients; the last micro-batch syncs.
            assert step == {"differ_after_no_sync": True, "equal_after_sync": True}
    results = job.training
    assert results["accumulated_ranks_agree"]
    expected, steps = plain_pytorch(results["x"], results["y"], results["initial_accumulating"],
                                    2 * MICRO_BATCH, accumulate=2)
    assert results["accumulated_steps"] == steps == 4
    assert_weights_match(results["accumulated_final"], expected, results["initial_accumulating"])


# -- objects passed into run() -----------------------------------------------------------------------
def test_a_model_passed_into_run_is_each_ranks_own(run_script, output_of, tmp_path):
    # Spawned ranks receive tensors through shared memory: without a copy per rank, both ranks
    # updated the same weights and the result drifted from DDP's by about 3e-4, run to run.
    proc = run_script("passed_into_run.py", tmp_path)
    assert proc.returncode == 0, output_of(proc)
    reference = torch.load(tmp_path / "reference.pt", weights_only=True)
    for strategy in ("ddp_spawn", "ddp_fork"):
        weights = torch.load(tmp_path / f"{strategy}.pt", weights_only=True)
        assert weights.keys() == reference.keys()
        for key, value in reference.items():
            assert torch.equal(weights[key], value), (strategy, key, (weights[key] - value).abs().max())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_save_right_after_a_load_waits_for_every_rank_to_read(strategy, training_job):
    # Rank 0 wrote the next step over the checkpoint while rank 1 was still to read it: rank 1
    # resumed from step 2, rank 0 from step 1, silently.
    assert [checks["load_then_save"] for checks in training_job(strategy).checks] == [1, 1]

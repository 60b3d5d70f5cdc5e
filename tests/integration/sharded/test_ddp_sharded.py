"""`ddp_sharded` / `ddp_sharded_spawn` (fairscale OSS + ShardedDataParallel) on 2 real processes:
parity with one plain PyTorch process although the loop calls `zero_grad()` with PyTorch's default
`set_to_none=True`, accumulation with `no_backward_sync`, clipping, and a checkpoint round trip.

Needs fairscale: run with `hatch run test-fairscale:all`.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("fairscale", reason="fairscale is not installed: run `hatch run test-fairscale:all`")

pytestmark = [pytest.mark.multiprocess, pytest.mark.fairscale, pytest.mark.timeout(150)]

STRATEGIES = ["ddp_sharded", "ddp_sharded_spawn"]


@pytest.fixture(scope="module")
def sharded_job(run_script, output_of, tmp_path_factory):
    jobs = {}

    def get(strategy: str) -> dict:
        if strategy not in jobs:
            out_dir = tmp_path_factory.mktemp(strategy)
            proc = run_script("sharded_train.py", strategy, out_dir)
            assert proc.returncode == 0, output_of(proc)
            jobs[strategy] = torch.load(out_dir / "training.pt", weights_only=True)
        return jobs[strategy]

    return get


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sharded_ddp_with_clipping_matches_plain_pytorch(strategy, sharded_job, reference):
    job = sharded_job(strategy)
    expected, norms = reference.plain_pytorch(job, "clipped", batch=4, accumulate=1, clip=True)
    reference.assert_weights_match(job["clipped_final"], expected, job["clipped_initial"])
    torch.testing.assert_close(torch.tensor(job["clipped_norms"]), torch.tensor(norms), atol=1e-5, rtol=0)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sharded_ddp_accumulation_with_no_backward_sync(strategy, sharded_job, reference):
    job = sharded_job(strategy)
    assert job["accumulated_unreduced"] == [True] * 4, "gradients were synchronised inside no_backward_sync"
    expected, _ = reference.plain_pytorch(job, "accumulated", batch=2, accumulate=2, clip=False)
    reference.assert_weights_match(job["accumulated_final"], expected, job["accumulated_initial"])


def test_sharded_ddp_checkpoint_round_trip(sharded_job):
    assert sharded_job("ddp_sharded")["round_trip_equal"]


# About 40 s on 2 shared cores (one job saving twice, then a load here); 400 s is a hang guard only.
@pytest.mark.timeout(400)
def test_a_bucket_holds_what_a_local_folder_holds_under_ddp_sharded(run_script, output_of, s3_server, s3_bucket,
                                                                     tmp_path):
    """`ddp_sharded` at an `s3://` URL (moto's server on loopback): the OSS optimizer's shards are
    gathered on rank 0, which writes one file to the bucket; the same training saved to a local
    folder gives identical checkpoints, resumes the same, and one process loads what 2 saved
    straight from the bucket (`tests/scripts/cloud_checkpoint.py`, as for the other strategies in
    `tests/integration/test_cloud_checkpoints.py`)."""
    remote = run_script("cloud_checkpoint.py", "ddp_sharded", "train", f"{s3_bucket}/run", tmp_path / "run",
                        env=s3_server.env, timeout=300)
    assert remote.returncode == 0, output_of(remote)
    digests = [line for line in remote.stdout.splitlines() if line.startswith("digest")]
    local = [line.removeprefix("local ") for line in remote.stdout.splitlines() if line.startswith("local digest")]
    assert len(digests) == 4 and digests == local and "equal False" not in remote.stdout, output_of(remote)
    assert "latest step-3" in remote.stdout, output_of(remote)
    from lite_core import LightningLite

    content = LightningLite(accelerator="cpu").load(f"{s3_bucket}/run/step-2")
    assert content["step"] == 2 and sorted(content["optimizer"]["state"])  # the gathered optimizer state
    assert not (tmp_path / "s3:").exists()

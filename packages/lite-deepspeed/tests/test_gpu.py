"""DeepSpeed on CUDA: which GPU DeepSpeed takes, and plain torch in run() under ZeRO-3.

The decision (`device_rank`) is checked on every machine; the tests marked `cuda` run where CUDA
GPUs are visible (`benchmarks/gpu_check.sh` runs them) and are skipped, with the reason, elsewhere.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from lite_core.errors import ConfigurationError
from lite_core.plugins import forward_module

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lite_deepspeed") is None or importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed here: these tests run in `hatch run test-deepspeed:all`",
)
GPUS = torch.cuda.device_count()


def needs_gpus(count: int):
    def mark(test):
        skip = pytest.mark.skipif(GPUS < count, reason=f"needs {count} CUDA GPU(s); this machine has {GPUS}")
        return pytest.mark.cuda(skip(test))

    return mark


@pytest.mark.parametrize(("accelerator", "index", "local_rank", "expected"), [
    ("cuda", 0, 0, None),   # devices=2: LOCAL_RANK already names the GPU
    ("cuda", 1, 0, 1),      # devices=[1]
    ("cuda", 3, 1, 3),      # devices=[2, 3], second process
    ("cpu", None, 1, None),
])
def test_deepspeed_takes_the_gpu_lite_chose(accelerator, index, local_rank, expected):
    from lite_deepspeed.strategy import device_rank

    device = torch.device(accelerator, index) if index is not None else torch.device(accelerator)
    assert device_rank(accelerator, device, local_rank, {"zero_optimization": {"stage": 3}}) == expected


def test_gpu_list_that_node_local_checkpoints_cannot_honour_is_refused():
    from lite_deepspeed.strategy import device_rank

    config = {"checkpoint": {"use_node_local_storage": True}}
    assert device_rank("cuda", torch.device("cuda", 0), 0, config) is None
    with pytest.raises(ConfigurationError, match="local rank 0 runs on GPU 2: pass devices=N") as err:
        device_rank("cuda", torch.device("cuda", 2), 0, config)
    assert "\n" not in str(err.value) and str(err.value).endswith(".")


def test_local_rank_is_swapped_only_while_deepspeed_reads_it(monkeypatch):
    import os

    from lite_deepspeed.strategy import _local_rank_env

    monkeypatch.setenv("LOCAL_RANK", "0")
    with _local_rank_env(3):
        assert os.environ["LOCAL_RANK"] == "3"
    assert os.environ["LOCAL_RANK"] == "0"


@needs_gpus(1)
def test_zero3_bf16_on_a_gpu_leaves_run_plain_and_trains_foreach_adamw():
    from lite_core import LightningLite

    class Run(LightningLite):
        def run(self):
            generator = torch.Generator().manual_seed(1)
            made = [torch.tensor(0.0), torch.randn(2, generator=generator), torch.zeros(2)]
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
            initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
            model, optimizer = self.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True))
            for _ in range(3):
                loss = model(self.to_device(torch.randn(4, 8, generator=generator))).pow(2).mean()
                self.backward(loss, model=model)
                optimizer.step()
                optimizer.zero_grad()
            return [(t.dtype, t.device.type) for t in made], initial, loss.item()

    made, initial, loss = Run(accelerator="cuda", strategy="deepspeed_stage_3", devices=1, precision="bf16-mixed").run()
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).state_dict()
    assert made == [(torch.float32, "cpu")] * 3
    assert all(torch.equal(initial[k], plain[k]) for k in plain)  # the CPU generator, as plain PyTorch
    assert torch.isfinite(torch.tensor(loss))


@needs_gpus(2)
def test_devices_list_puts_the_engine_and_zero3_shards_on_that_gpu():
    from lite_core import LightningLite

    class Run(LightningLite):
        def run(self):
            with self.init_module():
                model = nn.Linear(8, 8)
            model, _ = self.setup(model, torch.optim.Adam(model.parameters()))
            engine = forward_module(model)
            return str(engine.device), str(next(engine.module.parameters()).ds_tensor.device)

    assert Run(accelerator="cuda", strategy="deepspeed_stage_3", devices=[1]).run() == ("cuda:1", "cuda:1")

"""Context parallelism on 4 CPU processes, data 2 x context 2 (`tests/scripts/context_parallel_job.py`,
one start of the processes): the set-up loader's sequences and a named buffer cut head-tail,
gradients averaged over data x context, the run equal to one plain process; and the CPU's refusals. torch's
ring attention itself runs only on GPUs: `benchmarks/gpu_check.sh` tests it against the unsplit
model where two GPUs are lent."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]  # hang guard: the job takes ~10 s idle

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "context_parallel_job.py"
_spec = importlib.util.spec_from_file_location("context_parallel_job", _SCRIPT)
job_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(job_module)


@pytest.fixture(scope="module")
def job(run_script, output_of, tmp_path_factory):
    out = tmp_path_factory.mktemp("context_parallel")
    proc = run_script(_SCRIPT, out, timeout=240, env={"LITE_COLLECTIVE_TIMEOUT": "60"})
    assert proc.returncode == 0, output_of(proc)
    return torch.load(out / "results.pt", weights_only=True)


def _head_tail(sequence: torch.Tensor, rank: int, size: int = 2) -> torch.Tensor:
    """Chunks `rank` and `2 x size - 1 - rank` of `2 x size` along the sequence (torch's balancer)."""
    chunks = sequence.chunk(2 * size, dim=-1)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim=-1)


def _whole(head_tail: torch.Tensor, size: int = 2) -> torch.Tensor:
    """Undo the head-tail cut: the sequences from the parts of ranks 0 .. size-1 (last dimension)."""
    chunks: list = [None] * (2 * size)
    for rank, part in enumerate(head_tail):
        chunks[rank], chunks[2 * size - 1 - rank] = part.chunk(2, dim=-1)
    return torch.cat(chunks, dim=-1)


def _groups(job) -> torch.Tensor:
    """(data-parallel group, step, batch, tokens): each group's whole sequences, rebuilt from its ranks'
    parts (rank = 2 x data-parallel rank + context-parallel rank)."""
    seen = job["train"]["seen"]  # (rank, step, batch, tokens)
    return torch.stack([_whole(seen[2 * group:2 * group + 2]) for group in range(2)])


def test_the_mesh_names_the_context_dimension(job) -> None:
    assert job["layout"] == {"pipeline": 1, "replicate": 1, "shard": 2, "context": 2, "tensor": 1, "expert": 1}
    assert job["dim_names"] == ("data_parallel", "context_parallel", "tensor_parallel")


def test_each_rank_gets_its_head_and_tail_of_its_groups_sequences(job) -> None:
    seen = job["train"]["seen"]
    assert seen.shape == (4, 3, job_module.BATCH, job_module.LENGTH // 2)
    groups = _groups(job)
    for rank in range(4):
        assert torch.equal(seen[rank], _head_tail(groups[rank // 2], rank % 2)), rank
    rows = groups.transpose(0, 1).flatten(0, 2)  # every sequence the job trained on
    expected = job_module.Tokens().ids[:, :-1]
    assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, expected.tolist()))  # each sample once


def test_a_named_buffer_is_cut_like_the_batches(job) -> None:
    position = job["train"]["position"]
    whole = job_module.positions(job_module.LENGTH)
    assert torch.equal(position, _head_tail(whole.T, 0).T)  # rank 0's part


def test_training_equals_one_plain_process_over_whole_sequences(job) -> None:
    train = job["train"]
    model = job_module.TokenModel()
    model.load_state_dict(train["initial"])
    optimizer = torch.optim.SGD(model.parameters(), lr=job_module.LR)
    by_ids = {tuple(row[:-1].tolist()): row for row in job_module.Tokens().ids}
    groups = _groups(job)
    losses = []
    for step in range(3):  # the global batch: both data-parallel groups' sequences
        rows = torch.stack([by_ids[tuple(ids.tolist())] for ids in groups[:, step].flatten(0, 1)])
        logits = model(rows[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert train["losses"] == pytest.approx(losses, abs=1e-6)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(train["weights"][name], value, atol=1e-6, rtol=0, msg=name)


def test_a_forward_without_attention_through_F_is_warned_about_once(job) -> None:
    warned = [w for w in job["train"]["warnings"] if "made no call to torch.nn.functional" in w]
    assert len(warned) == 1


def _one_sentence(message: str) -> bool:
    return message.count(". ") == 0 and message.endswith(".")


@pytest.mark.parametrize(("case", "start"), [
    ("cpu", "MisuseError: context_parallel_size > 1 runs scaled_dot_product_attention as torch's ring attention,"
            " which has no CPU kernel"),
    ("mask", "MisuseError: scaled_dot_product_attention got an attn_mask, which torch's ring attention"),
    ("data only", "MisuseError: Parameter 'qkv.weight' is not sharded over the data-parallel and context-parallel"
                  " ranks"),
    ("context only", "MisuseError: Parameter 'qkv.weight' is not sharded over the data-parallel and"
                     " context-parallel ranks"),
    ("uneven", "MisuseError: context_parallel_size=2 cuts sequences into 4 equal chunks, but got sequence lengths"
               " [6]"),
])
def test_what_the_ring_cannot_do_is_refused_in_one_sentence(job, case, start) -> None:
    message = job["refusals"][case]
    assert message.startswith(start), message
    assert _one_sentence(message)

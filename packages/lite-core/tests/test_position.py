"""The set-up loader's global position on one process: a mid-epoch save resumes at the next sample
for every sampler Lite can draw again, without fetching the skipped samples; the order a split
batch is cut from; what `split_batches=True` refuses."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, Sampler

from lite_core import LightningLite
from lite_core.data._order import SplitBatches, rank_slice
from lite_core.data._sharding import split_batches
from lite_core.strategies import SingleDeviceStrategy
from lite_core.errors import MisuseError


class Counting(Dataset):
    """Sample `i` is `i`; counts the samples fetched."""

    def __init__(self, size: int) -> None:
        self.size, self.fetched = size, 0

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        self.fetched += 1
        return index


def batches(loader) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [batch.tolist() for batch in loader]


def interrupted_and_resumed(make, tmp_path: Path, after: int, epochs: int = 2):  # type: ignore[no-untyped-def]
    """The batches of `epochs` uninterrupted passes, and those of a run saved `after` batches in and resumed."""
    lite = LightningLite(accelerator="cpu")
    torch.manual_seed(0)
    uninterrupted = [batches(loader) for loader in [lite.setup_dataloaders(make())] for _ in range(epochs)]
    torch.manual_seed(0)
    loader = lite.setup_dataloaders(make())
    seen = []
    for batch in loader:
        seen.append(batch.tolist())
        if len(seen) == after:
            lite.save({"loader": loader}, tmp_path / "ckpt.pt")
            break
    torch.manual_seed(123)  # a restarted process stands elsewhere
    resumed = lite.setup_dataloaders(make())
    lite.load(tmp_path / "ckpt.pt", {"loader": resumed})
    rest = [batches(resumed) for _ in range(epochs)]
    return uninterrupted, seen, rest, resumed


@pytest.mark.parametrize("generator", [False, True], ids=["default-generator", "own-generator"])
def test_a_random_sampler_resumes_mid_epoch_at_the_next_sample(tmp_path: Path, generator: bool) -> None:
    def make() -> DataLoader:
        own = torch.Generator().manual_seed(5) if generator else None
        return DataLoader(Counting(20), batch_size=3, sampler=RandomSampler(range(20), generator=own))

    uninterrupted, seen, rest, _ = interrupted_and_resumed(make, tmp_path, after=2)
    assert seen + rest[0] == uninterrupted[0]  # the interrupted epoch finishes where it stood
    assert rest[1] == uninterrupted[1]  # and the next one shuffles as the uninterrupted run did


def test_a_stateful_dataloader_gets_the_global_position(tmp_path: Path) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    uninterrupted, seen, rest, resumed = interrupted_and_resumed(
        lambda: stateful.StatefulDataLoader(Counting(12), batch_size=2, shuffle=True), tmp_path, after=2)
    assert seen + rest[0] == uninterrupted[0] and rest[1] == uninterrupted[1]
    assert "dataloader" not in torch.load(tmp_path / "ckpt.pt", weights_only=True)["loader"]  # no per-rank state


def test_a_deep_resume_with_workers_fetches_no_skipped_sample(tmp_path: Path) -> None:
    lite = LightningLite(accelerator="cpu")
    data = Counting(10_000)
    loader = lite.setup_dataloaders(DataLoader(data, batch_size=10, shuffle=True))
    loader.load_state_dict({"epoch": 0, "consumed": 9_000, "order": {"seed": 3}})
    assert len(loader) == 100
    rest = [i for batch in loader for i in batch.tolist()]
    assert data.fetched == 1_000  # only the samples left
    order = torch.randperm(10_000, generator=torch.Generator().manual_seed(3)).tolist()
    assert rest == order[9_000:]
    with_workers = lite.setup_dataloaders(DataLoader(Counting(10_000), batch_size=10, shuffle=True, num_workers=2))
    with_workers.load_state_dict({"epoch": 0, "consumed": 9_000, "order": {"seed": 3}})
    assert next(iter(with_workers)).tolist() == order[9_000:9_010]


class Fixed(Sampler[int]):
    """A custom sampler with no state: Lite cannot draw its order again."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(10))

    def __len__(self) -> int:
        return 10


def test_a_sampler_lite_cannot_draw_again_is_named_at_load(tmp_path: Path) -> None:
    lite = LightningLite(accelerator="cpu")
    loader = lite.setup_dataloaders(DataLoader(Counting(10), batch_size=2, sampler=Fixed()))
    next(iter(loader))
    state = loader.state_dict()
    assert state["consumed"] == 2
    fresh = lite.setup_dataloaders(DataLoader(Counting(10), batch_size=2, sampler=Fixed()))
    with pytest.warns(UserWarning, match=r"sampler \(Fixed\) has no set_epoch\(\), state_dict\(\) or generator"):
        fresh.load_state_dict({**state, "processes": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lite.setup_dataloaders(DataLoader(Counting(10), batch_size=2, shuffle=True)).load_state_dict(
            {"epoch": 0, "consumed": 4, "order": {"seed": 1}})


def test_the_set_up_loader_is_a_dataloader() -> None:
    loader = LightningLite(accelerator="cpu").setup_dataloaders(DataLoader(Counting(10), batch_size=4))
    assert isinstance(loader, DataLoader)
    assert (loader.batch_size, len(loader.dataset), len(loader)) == (4, 10, 3)


def test_a_global_batch_is_cut_into_contiguous_parts_one_per_process() -> None:
    assert [rank_slice(list(range(12)), r, 3) for r in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert [rank_slice(list(range(5)), r, 2) for r in range(2)] == [[0, 1, 2], [3, 4]]  # a short last batch
    global_batches = BatchSampler(range(10), 4, drop_last=False)
    parts = [list(SplitBatches(global_batches, lambda r=r: (r, 2))) for r in range(2)]
    assert [a + b for a, b in zip(*parts)] == list(global_batches)


def test_split_batches_refuses_a_batch_the_processes_do_not_divide() -> None:
    with pytest.raises(MisuseError, match="batch of 10 samples over 4 data-parallel processes"):
        split_batches(DataLoader(Counting(40), batch_size=10), lambda: (0, 4), 4)
    with pytest.raises(MisuseError, match="last batch holds 1 samples, fewer than the 2.*drop_last=True"):
        split_batches(DataLoader(Counting(9), batch_size=4), lambda: (0, 2), 2)
    split_batches(DataLoader(Counting(9), batch_size=4, drop_last=True), lambda: (0, 2), 2)


def test_a_stateful_dataloader_sharded_over_ranks_resumes_at_the_next_sample_on_another_world_size() -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    from lite_core.data._sharding import distribute
    from lite_core.data._lite_loader import LiteDataLoader

    def shards(world: int) -> list[LiteDataLoader]:  # every rank's loader, as each rank would build it
        loaders = []
        for rank in range(world):
            torch.manual_seed(4)  # torchdata's RandomSampler draws its generator's seed at construction
            loaders.append(LiteDataLoader(distribute(stateful.StatefulDataLoader(
                Counting(24), batch_size=2, shuffle=True), world, rank, 0), None))
        return loaders

    one = shards(1)[0]
    uninterrupted = [[i for batch in one for i in batch.tolist()] for _ in range(2)][1]  # the 2nd epoch
    before = shards(2)
    for loader in before:
        list(loader)  # the first epoch: the sampler's generator moves on
    steps = [iter(loader) for loader in before]
    seen = [i for _ in range(3) for it in steps for i in next(it).tolist()]  # 3 steps: 12 samples
    state = before[0].state_dict()
    assert (state["epoch"], state["consumed"]) == (1, 12)
    after = shards(3)
    for loader in after:
        loader.load_state_dict(state)
    rest = [list(loader) for loader in after]
    rest = [i for step in zip(*rest) for batch in step for i in batch.tolist()]
    assert sorted(seen) == sorted(uninterrupted[:12]) and sorted(rest) == sorted(uninterrupted[12:])


def test_per_rank_batches_warn_at_load_only_where_the_global_batch_changes() -> None:
    """2 ranks of 6 resumed on 3 ranks of 4 keep the global batch of 12 (the user resized it by
    hand): no warning; on 3 ranks of 6 it grows to 18, which the warning names."""
    from lite_core.data._sharding import distribute
    from lite_core.data._lite_loader import LiteDataLoader

    def rank_zero(world: int, batch_size: int) -> LiteDataLoader:
        return LiteDataLoader(distribute(DataLoader(Counting(36), batch_size=batch_size, shuffle=True), world, 0, 0),
                              None)

    saved = rank_zero(2, 6)
    next(iter(saved))
    state = saved.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rank_zero(3, 4).load_state_dict(state)
    with pytest.warns(UserWarning, match=r"^This dataloader was saved on 2 processes taking 12 samples per step, and"
                                         r" resumes on 3 taking 18, .*split_batches=True"):
        rank_zero(3, 6).load_state_dict(state)


def test_split_batches_needs_lite_to_draw_the_batches() -> None:
    with pytest.raises(MisuseError, match="split_batches=True.*replace_sampler=False"):
        LightningLite(accelerator="cpu").setup_dataloaders(DataLoader(Counting(8), batch_size=4),
                                                           split_batches=True, replace_sampler=False)


class _UnshardedDistributed(SingleDeviceStrategy):
    """A distributed strategy that leaves loaders unsharded (as `ddp_ft`, which splits batches itself)."""

    name = "unsharded_distributed"
    is_distributed = True


def test_split_batches_is_refused_where_the_strategy_does_not_shard_loaders() -> None:
    # Before, the flag was dropped silently: every process took the whole batch.
    lite = LightningLite(accelerator="cpu", strategy=_UnshardedDistributed())
    lite.launch()
    with pytest.raises(MisuseError, match="split_batches=True.*'unsharded_distributed'.*own option"):
        lite.setup_dataloaders(DataLoader(Counting(8), batch_size=4), split_batches=True)


class _SplittingUnshardedDistributed(_UnshardedDistributed):
    """One that cuts global batches itself (as `ddp_ft` does per step): it takes over the flag."""

    def __init__(self) -> None:
        super().__init__()
        self.global_batch_loaders: list[DataLoader] = []

    def take_global_batches(self, dataloader: DataLoader) -> bool:
        self.global_batch_loaders.append(dataloader)
        return True

    def process_dataloader(self, dataloader: DataLoader) -> list[torch.Tensor]:
        taken = any(loader is dataloader for loader in self.global_batch_loaders)
        return [batch[:2] if taken else batch for batch in dataloader]  # this process's half


def test_split_batches_reaches_a_strategy_that_cuts_global_batches_itself() -> None:
    lite = LightningLite(accelerator="cpu", strategy=_SplittingUnshardedDistributed())
    lite.launch()
    split = lite.setup_dataloaders(DataLoader(Counting(8), batch_size=4), split_batches=True)
    whole = lite.setup_dataloaders(DataLoader(Counting(8), batch_size=4))
    assert [b.tolist() for b in split] == [[0, 1], [4, 5]]  # the loader handed over is the one iterated
    assert [b.tolist() for b in whole] == [[0, 1, 2, 3], [4, 5, 6, 7]]


class _GroupEvaluating(_UnshardedDistributed):
    """One whose training passes are unsharded but whose evaluation passes shard over a group
    (as `ddp_ft`: each replica group evaluates the whole set over its own processes)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.group_rank = rank

    def evaluation_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": 2, "rank": self.group_rank}


def test_evaluation_passes_shard_over_the_strategy_s_evaluation_group_where_training_is_unsharded() -> None:
    loaders = []
    for rank in (0, 1):
        lite = LightningLite(accelerator="cpu", strategy=_GroupEvaluating(rank))
        lite.launch()
        loaders.append(lite.setup_dataloaders(DataLoader(Counting(10), batch_size=4)))
    with torch.no_grad():
        evaluated = [batches(loader) for loader in loaders]
    assert len(evaluated[0]) == len(evaluated[1])  # as many batches on every rank
    assert sorted(i for shard in evaluated for batch in shard for i in batch) == list(range(10))  # each sample once
    assert batches(loaders[1]) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]  # a training pass: the whole loader

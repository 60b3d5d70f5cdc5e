"""`LoaderStream`, the loader's part in the quorum, in this process: a group that takes a peer's
position of a shuffled loader goes on with the peer's order of the epoch, whatever its own
generators drew before (as a group started again, or healed at its first quorum, does)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from lite_torchft._stream import LoaderStream


def _loader(generator: torch.Generator | None) -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(24)), batch_size=4, shuffle=True, generator=generator)


def _one_step(index: int = 0, count: int = 1) -> tuple[int, int]:
    return index, count


def _take(stream: LoaderStream, steps: int) -> list[list[int]]:
    taken, batches = [], stream.batches(_one_step)
    for _ in range(steps):
        (rows,) = next(batches)
        taken.append(rows.tolist())
        stream.commit()
    return taken


def test_a_peer_position_of_a_shuffled_loader_continues_the_peers_order() -> None:
    for generator in (torch.Generator().manual_seed(3), None):  # its own generator, or torch's default one
        peer = LoaderStream(_loader(generator), split_batches=True)
        torch.manual_seed(0)
        first = _take(peer, 2)
        position = peer.state_dict()
        rest = _take(peer, 4)
        assert sorted(sum(first + rest, [])) == list(range(24))
        # another process, whose generators drew something else before it took the peer's position
        own = torch.Generator().manual_seed(99) if generator is not None else None
        torch.manual_seed(1)
        healed = LoaderStream(_loader(own), split_batches=True)
        if own is not None:
            own.set_state(torch.Generator().manual_seed(99).get_state())
        healed.load_state_dict(position)
        assert _take(healed, 4) == rest, "the healed stream drew its own order of the epoch"


def _committed_pass(stream: LoaderStream, begin_step=_one_step) -> list[list[int]]:
    """One pass of `stream`, every step committed."""
    taken = []
    for (rows,) in stream.batches(begin_step):
        taken.append(rows.tolist())
        stream.commit()
    return taken


def test_a_heal_into_the_peers_next_epoch_ends_the_pass_under_way() -> None:
    """A group started again resumes mid-epoch from a checkpoint and heals at its first quorum from
    a peer that has begun the next epoch: the pass under way (the user's loop's epoch) ends there,
    and the next pass is the peer's epoch from its position. Found by the chaos job: the pass went
    on with the next epoch's batches, and the user's loop trained a third epoch."""
    loader = DataLoader(TensorDataset(torch.arange(24)), batch_size=4)
    peer = LoaderStream(loader, split_batches=True)
    assert len(_committed_pass(peer)) == 6
    assert _take(peer, 1) == [[0, 1, 2, 3]]  # one step into epoch 1
    position = peer.state_dict()
    assert (position["epoch"], position["committed"]) == (1, 1)

    healed = LoaderStream(loader, split_batches=True)
    healed.load_state_dict({"epoch": 0, "committed": 3})  # the checkpoint it resumed from
    heals = [lambda: healed.load_state_dict(position)]  # due at its first quorum

    def begin_step() -> tuple[int, int]:
        if heals:
            heals.pop()()
        return 0, 1

    assert _committed_pass(healed, begin_step) == [], "the pass of epoch 0 went on with epoch 1's batches"
    assert _committed_pass(healed) == [[4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15], [16, 17, 18, 19],
                                       [20, 21, 22, 23]]
    assert healed.epoch == 2


class _EpochOrder(torch.utils.data.IterableDataset):
    """A stream whose order its epoch picks, set before each pass as lite-core sets a Hugging Face
    shuffle buffer's (`set_epoch`)."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(24, generator=torch.Generator().manual_seed(self.epoch)).tolist()
        return iter([(i,) for i in order])  # rows as a TensorDataset's: a batch is `(tensor,)`


def _peer_one_step_into_epoch_1(loader: DataLoader, data: _EpochOrder) -> tuple[dict, list[list[int]]]:
    """A peer's position one committed step into epoch 1 of `data`, and the batches left of it."""
    peer = LoaderStream(loader, split_batches=True)
    assert len(_committed_pass(peer)) == 6
    data.set_epoch(1)
    assert len(_take(peer, 1)) == 1
    order = torch.randperm(24, generator=torch.Generator().manual_seed(1)).tolist()
    return peer.state_dict(), [order[i:i + 4] for i in range(4, 24, 4)]


def test_a_heal_in_the_optimizer_steps_sync_into_the_peers_next_epoch_draws_the_peers_order() -> None:
    """Under an algorithm (`diloco`) a group heals in its optimizer step's sync, after the step's
    batch, not at the next batch's quorum: the pass under way ends there too, and the next pass,
    its stream's epoch set, is the peer's epoch from its position. Found by the chaos job's diloco
    configuration: the pass fetched the peer's position in the old epoch's order before it ended,
    and the next pass went on with that iterator (epoch 0's order in epoch 1)."""
    data = _EpochOrder()
    loader = DataLoader(data, batch_size=4)
    position, rest = _peer_one_step_into_epoch_1(loader, data)

    healed = LoaderStream(loader, split_batches=True)
    healed.load_state_dict({"epoch": 0, "committed": 3})  # the checkpoint it resumed from
    data.set_epoch(0)  # lite-core, at the pass's start
    taken = []
    for (rows,) in healed.batches(_one_step):
        taken.append(rows.tolist())
        healed.commit()
        if len(taken) == 1:
            healed.load_state_dict(position)  # the sync of this step's optimizer step heals it
    assert len(taken) == 1, "the pass of epoch 0 went on after the heal"
    data.set_epoch(1)
    assert _committed_pass(healed) == rest, "the next pass did not draw the peer's epoch from its position"
    assert healed.epoch == 2


def test_a_checkpoint_taken_after_a_heal_into_the_next_epoch_resumes_in_the_users_epoch() -> None:
    """The user's loop saves right after the optimizer step whose sync healed it into the peer's
    next epoch, its own epoch counter still the old one (the pass ends at the loop's next batch).
    Resumed from that checkpoint, the loop finishes the old epoch's pass with no batch and the next
    pass is the peer's epoch from its position. Found by the diloco chaos soak (seed 21): the
    resumed loop trained epoch 1 as its epoch 0, then a third epoch alone."""
    data = _EpochOrder()
    loader = DataLoader(data, batch_size=4)
    position, rest = _peer_one_step_into_epoch_1(loader, data)

    healed = LoaderStream(loader, split_batches=True)
    healed.load_state_dict({"epoch": 0, "committed": 3})
    data.set_epoch(0)
    batches = healed.batches(_one_step)
    next(batches)
    healed.commit()
    healed.load_state_dict(position)  # the sync of this step's optimizer step heals it
    saved = healed.state_dict()  # the user's save, its loop still in epoch 0's pass
    assert saved["pass_over"] and (saved["epoch"], saved["committed"]) == (1, 1)

    resumed = LoaderStream(loader, split_batches=True)  # the group started again from that checkpoint
    resumed.load_state_dict(saved, resumed=True)
    assert resumed.state_dict()["pass_over"]  # a save before its first pass keeps it
    assert _committed_pass(resumed) == [], "the resumed loop's epoch 0 trained epoch 1's batches"
    data.set_epoch(1)
    assert _committed_pass(resumed) == rest
    assert resumed.epoch == 2 and "pass_over" not in resumed.state_dict()


def test_a_peers_position_ends_no_pass_of_its_own() -> None:
    """A peer's `pass_over` says where the peer's loop is, not the healed group's: a heal ignores it."""
    loader = DataLoader(TensorDataset(torch.arange(24)), batch_size=4)
    healed = LoaderStream(loader, split_batches=True)
    healed.load_state_dict({"epoch": 1, "committed": 1, "pass_over": True})
    assert _committed_pass(healed) == [[4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15], [16, 17, 18, 19],
                                       [20, 21, 22, 23]]

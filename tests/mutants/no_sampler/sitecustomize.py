"""Mutant: the distributed sampler is not injected (every rank iterates the whole dataset)."""

from torch.utils.data import distributed

_init = distributed.DistributedSampler.__init__


def _one_replica(self, dataset, num_replicas=None, rank=None, *args, **kwargs):
    _init(self, dataset, 1, 0, *args, **kwargs)


distributed.DistributedSampler.__init__ = _one_replica

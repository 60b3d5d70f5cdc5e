"""Mutant: gradients are not all-reduced (every DDP forward skips the gradient synchronisation)."""

from torch.nn.parallel import distributed

_forward = distributed.DistributedDataParallel.forward


def _forward_without_sync(self, *args, **kwargs):
    self.require_backward_grad_sync = False
    return _forward(self, *args, **kwargs)


distributed.DistributedDataParallel.forward = _forward_without_sync

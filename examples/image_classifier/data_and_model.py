"""A synthetic image dataset (nothing to download) and a small CNN, shared by both training scripts.

Each of the 10 classes is a fixed random 16x16 pattern; a sample is its class's pattern, shifted
by up to 2 pixels, under strong noise. A CNN learns it within an epoch; a linear model does not.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

NUM_CLASSES = 10
IMAGE_SIZE = 16


def make_dataset(samples: int, seed: int) -> TensorDataset:
    """`samples` noisy, shifted images of the class patterns (the patterns do not depend on `seed`)."""
    patterns = torch.randn(NUM_CLASSES, 1, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(NUM_CLASSES, (samples,), generator=generator)
    shifts = torch.randint(-2, 3, (samples, 2), generator=generator)
    images = torch.stack([torch.roll(patterns[label], tuple(shift.tolist()), dims=(1, 2))
                          for label, shift in zip(labels, shifts)])
    images = images + 1.0 * torch.randn(images.shape, generator=generator)
    return TensorDataset(images, labels)


def make_model() -> nn.Module:
    """Two convolutions, two poolings, one linear classifier."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * (IMAGE_SIZE // 4) ** 2, NUM_CLASSES),
    )

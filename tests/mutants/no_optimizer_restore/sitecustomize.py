"""Mutant: a checkpoint restores the model but not the optimizer."""

import torch

torch.optim.Optimizer.load_state_dict = lambda self, state_dict: None

"""Setting up models and optimizers for a strategy, and the backward pass through it."""

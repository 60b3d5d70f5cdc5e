"""From the constructor's arguments to one connected strategy: defaults from the environment,
argument checks, and the connector that joins accelerator, strategy, devices and precision."""

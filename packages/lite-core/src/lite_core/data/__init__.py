"""Dataloaders set up for a strategy: sharding, the job's global sample order, a loader's position,
and the rows gathered for metrics."""

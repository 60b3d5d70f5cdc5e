"""The XLA strategies: `single_xla` (one device), `xla` (data parallel) and `xla_fsdp`."""

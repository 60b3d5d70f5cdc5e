"""How the user's code runs: `run()` wrapped to launch, each process's execution of it, and the
collectives `LightningLite` offers between processes."""

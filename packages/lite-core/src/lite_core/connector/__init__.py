"""From the constructor's arguments to the job's `Plan`: defaults from the environment, argument
checks, the connector that joins accelerator, strategy, devices and precision, and the frozen plan
it returns (accelerator, environment, precision, checkpoint IO, strategy, launcher)."""

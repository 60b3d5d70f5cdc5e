"""The set-up model (the user's own module, its class swapped for a subclass) and optimizer: their
methods, the changes a strategy cannot follow, compile options, empty initialisation, and which
passes over them evaluate."""

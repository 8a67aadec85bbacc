"""The scheduling core: requests, the scheduler and its records, prefill groups,
grammar constraints. Bookkeeping only: nothing here imports MLX, so the
simulator runs on it alone."""

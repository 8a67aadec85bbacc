"""The engine: an mlx-lm model driven through the scheduling core over paged
storage (`Engine`), with its sampling, text, speculation, forward faults,
batch probe and KV events. Imports `scheduler.core` only."""

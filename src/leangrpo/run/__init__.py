"""A run on disk: its config resolved from a file, the run directory and its lock, checkpoints, trained
models located and loaded, signals, metrics and trackers. Imports every layer below it (core to cpu)."""

"""CPU-only speed levers: the lean decode loop, packed weights, oneDNN products, glibc's allocator, the
reference copy on disk. Reached only through `levers.CPULevers`, which train/levers.py builds for a model
on CPU; never imported on CUDA. Imports core, config, data, models and engines."""

"""Generation: Sampling, the RolloutBatch, the HF engine and the colocated vLLM engine. Imports core,
config, data and models; a device's speed levers come in from above (GenerateLevers)."""

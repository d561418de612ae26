"""Generation: what every engine shares (types.py), the HF engine (hf.py), vLLM's, colocated or behind a
server (vllm*.py), tool calls (tools.py) and agents (agents.py, openenv.py), and the registry that builds the
one a config picks (registry.py). Imports core, config, data and models; a device's speed levers come in
from above (GenerateLevers)."""

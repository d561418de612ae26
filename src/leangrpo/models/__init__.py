"""Loading models (hub, directory, GGUF, the packaged demo model), LoRA, 4-bit, frozen copies, saving.
Imports core and config."""

"""leangrpo: memory-lean GRPO for small language models."""

__version__ = "0.1.0"

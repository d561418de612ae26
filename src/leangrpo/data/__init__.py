"""What to learn: data sources -> rows, prompts, tasks/ (answer format, correctness, default rewards) and
rewards/ (TRL's reward contract, scoring). Imports core and config."""

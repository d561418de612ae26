"""`leangrpo eval`: a trained model (run, checkpoint, export) or any model on held-out questions, with the
task, prompt format and rewards of its training config unless told otherwise."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Literal

from leangrpo.config.schema import Config, CPUConfig, DataConfig, RewardSpec, TaskConfig
from leangrpo.data.rewards import load_rewards
from leangrpo.data.rewards.registry import foreign_rewards
from leangrpo.data.tasks import load_task
from leangrpo.engines.rollout import HFEngine, RolloutEngine, eos_token_ids
from leangrpo.engines.vllm import VLLMEngine, import_vllm
from leangrpo.run.resolve import load_config, validate_config
from leangrpo.run.rundir import check_writable, is_run_dir
from leangrpo.run.trained import load_trained, locate
from leangrpo.run.trust import TRUST_FLAG, is_run_owned
from leangrpo.train.engine import cpu_levers
from leangrpo.train.evaluation import EvalError, EvalResult, evaluate, load_eval_rows, resolve_data_path

log = logging.getLogger(__name__)


def run_eval(
    model: str,
    *,
    adapter: str | None = None,
    data: str | None = None,
    split: str = "test",
    limit: int | None = None,
    num_samples: int = 0,
    out: str | None = None,
    config: str | None = None,
    rewards: tuple[str, ...] = (),
    max_new_tokens: int | None = None,
    batch_size: int = 16,
    seed: int = 0,
    dtype: str | None = None,
    trust_remote_code: bool = False,
    trust_run_code: bool = False,
    engine: Literal["hf", "vllm"] = "hf",
) -> tuple[EvalResult, Path]:
    """`leangrpo eval`: task, prompt format, rewards and lengths come from `config` (a run config YAML or
    run directory; by default the training config of `model` when it is a run, checkpoint or export),
    else the default task's. Every input is checked before the model loads. Correctness needs no reward
    code: rewards that a run's own config names beyond leangrpo's are skipped with a note unless
    `trust_run_code` (see `run.trust`)."""
    if not re.fullmatch(r"\w[\w.-]*", split):
        raise EvalError(f"--split {split!r} is not a split name (letters, digits, '_', '.', '-')")
    trained = locate(model)
    if out is None:
        run_dir = trained.run_dir if trained else None
        out = str(run_dir / "eval" / f"eval-{split}.json") if run_dir else f"eval-{split}.json"
    check_writable(Path(out))  # before the evaluation, not after it
    if config:
        cfg: Config | None = load_config(Path(config) / "config.yaml" if is_run_dir(Path(config)) else config)
    else:
        cfg = validate_config(trained.config, f"the training config of {model}") if trained else None
    data = data or (cfg.eval.path if cfg else None)
    if not data:
        raise EvalError(
            "give the evaluation data with --data (a .jsonl/.parquet file, a directory, or a hub id)"
        )
    task = load_task(cfg.task if cfg else TaskConfig())
    data_cfg = cfg.data if cfg else DataConfig(path=data, system_prompt=task.system_prompt)
    specs = cfg.rewards.functions if cfg else []
    from_run = cfg is not None and (config is None or is_run_owned(config))
    if from_run and not trust_run_code and (skipped := foreign_rewards(specs)):
        log.warning(
            "note: not scoring %s: the run's config names them, and code from a run runs only with %s "
            "(or name them with --reward or in your own -c)",
            ", ".join(skipped),
            TRUST_FLAG,
        )
        specs = [s for s in specs if s.name not in skipped]
    if rewards or not specs:
        specs = [RewardSpec(name=n) for n in rewards or task.default_rewards]
    reward_funcs = load_rewards(specs, task)
    source = resolve_data_path(data, split)
    rows = load_eval_rows(data_cfg, task, source, split, limit)

    dtype = dtype or (cfg.model.dtype if cfg else None)
    if engine == "vllm":
        import_vllm()  # its one-line error before the model loads
    lm, tokenizer, _ = load_trained(model, dtype=dtype, adapter=adapter, trust_remote_code=trust_remote_code)
    max_new_tokens = max_new_tokens or (cfg.grpo.max_completion_length if cfg else 256)
    max_prompt_length = cfg.grpo.max_prompt_length if cfg else 512
    generator: RolloutEngine = HFEngine(lm, tokenizer, cpu_levers(lm.device, cfg.cpu if cfg else CPUConfig()))
    if engine == "vllm":  # vLLM loads the checkpoint, then takes the weights evaluated (adapter merged)
        assert lm.name_or_path is not None, "from_pretrained sets it"
        generator = VLLMEngine(
            lm.name_or_path, tokenizer, eos_token_ids(tokenizer, lm),
            max_model_len=max_prompt_length + max_new_tokens, dtype=dtype or "float32", seed=seed,
            trust_remote_code=trust_remote_code,
            gpu_memory_utilization=cfg.grpo.vllm_gpu_memory_utilization if cfg else 0.3,
        )  # fmt: skip
        generator.sync_weights(lm)
    result = evaluate(
        lm,
        tokenizer,
        rows,
        reward_funcs,
        task,
        assistant_prefix=data_cfg.assistant_prefix,
        max_new_tokens=max_new_tokens,
        max_prompt_length=max_prompt_length,
        batch_size=batch_size,
        num_samples=num_samples,
        temperature=cfg.grpo.temperature if cfg else 1.0,
        top_p=cfg.grpo.top_p if cfg else 1.0,
        seed=seed,
        engine=generator,
    )
    meta = {"model": model, "adapter": adapter, "data": source, "split": split, "num_samples": num_samples}
    return result, result.save(out, **meta)

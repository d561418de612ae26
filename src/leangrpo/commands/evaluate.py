"""`leangrpo eval`: a trained model (run, checkpoint, export) or any model on held-out questions, with the
task, prompt format, rewards and tools of its training config unless told otherwise."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from leangrpo.config.schema import (
    UNPLANNED_VLLM_SHARE,
    Config,
    CPUConfig,
    DataConfig,
    RewardSpec,
    TaskConfig,
)
from leangrpo.data.rewards import load_rewards
from leangrpo.data.rewards.registry import foreign_rewards
from leangrpo.data.rows import PromptFormat
from leangrpo.data.tasks import Task, load_task
from leangrpo.engines.agents import AgentSpec, agent_from_config
from leangrpo.engines.hf import HFEngine
from leangrpo.engines.tools import prepare_tokenizer
from leangrpo.engines.types import RolloutEngine, eos_token_ids
from leangrpo.engines.vision import image_processor, text_tokenizer
from leangrpo.engines.vllm import VLLMEngine, import_vllm
from leangrpo.run.resolve import Vet, load_config, validate_config
from leangrpo.run.rundir import check_writable
from leangrpo.run.trained import Trained, load_trained, locate
from leangrpo.run.trust import (
    TRUST_FLAG,
    admit,
    code_beside_the_user,
    is_run_owned,
    refusal,
    task_code,
    tool_code,
)
from leangrpo.train.evaluation import (
    EvalError,
    EvalResult,
    RewardFuncs,
    eval_sampling,
    evaluate,
    load_eval_rows,
    resolve_data_path,
)
from leangrpo.train.levers import cpu_levers

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

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
    path, root = _output(out, trained, split)
    runs = (config is None or is_run_owned(config)) and not trust_run_code  # the config is a run's
    cfg = _config_for(model, config, trained, _refuse_task_code if runs else _admit(config or model))
    untrusted = cfg is not None and runs
    if any(":" in name for name in rewards):  # the user names a module: found beside them too
        code_beside_the_user()
    inputs = _inputs(cfg, data, split, limit, rewards, untrusted)
    dtype = dtype or (cfg.model.dtype if cfg else None)
    if engine == "vllm":
        import_vllm()  # its one-line error before the model loads
    lm, processing, _ = load_trained(model, dtype=dtype, adapter=adapter, trust_remote_code=trust_remote_code)
    # a vision-language model's processor encodes the image prompts; its tokenizer the rest
    processor, tokenizer = image_processor(processing), text_tokenizer(processing)
    if inputs.agent is not None:
        prepare_tokenizer(tokenizer)
    sampling = eval_sampling(cfg.grpo if cfg else None, inputs.data, max_new_tokens)
    limit = sampling.max_prompt_length  # none: vLLM takes the model's own context
    max_model_len = None if limit is None else limit + sampling.max_completion_length
    generator = (
        _vllm_engine(lm, tokenizer, cfg, max_model_len, dtype, seed, trust_remote_code, processor)
        if engine == "vllm"
        else HFEngine(lm, tokenizer, cpu_levers(lm.device, cfg.cpu if cfg else CPUConfig()), processor)
    )
    result = evaluate(
        lm, tokenizer, inputs.rows, inputs.reward_funcs, inputs.task, sampling,
        prompt_format=PromptFormat.from_config(inputs.data, limit), batch_size=batch_size,
        num_samples=num_samples, seed=seed, engine=generator, agent=inputs.agent,
    )  # fmt: skip
    meta = dict(model=model, adapter=adapter, data=inputs.source, split=split, num_samples=num_samples)
    return result, result.save(path, root, **meta)


def _output(out: str | None, trained: Trained | None, split: str) -> tuple[Path, Path]:
    """Where the result goes: `out`, else the run's eval/ folder, else the working directory; checked
    writable now, before the evaluation rather than after it. Also the directory below which no link is
    followed to write it: the run's for its eval/."""
    run_dir = trained.run_dir if trained and not out else None
    path = Path(out or (run_dir / "eval" / f"eval-{split}.json" if run_dir else f"eval-{split}.json"))
    root = run_dir or path.parent
    check_writable(path, root)
    return path, root


def _config_for(model: str, config: str | None, trained: Trained | None, vet: Vet | None) -> Config | None:
    """The config the evaluation follows: `config` (a YAML file or run directory), else the training
    config of a trained `model`, else none (the default task's). `vet`: `resolve.validate_config`'s."""
    if config:
        return load_config(Path(config) / "config.yaml" if Path(config).is_dir() else config, vet=vet)
    return validate_config(trained.config, f"the training config of {model}", vet) if trained else None


def _admit(source: str) -> Vet:
    """A granted or the user's own config's check: `run.trust.admit`, the current directory on the import
    path only for a config outside any run that names a module."""
    return lambda cfg: admit(cfg, source, granted=True)


def _refuse_task_code(cfg: Config) -> None:
    """A run's config naming its task by import path: refused before the task is imported (`run.trust`)."""
    if task := task_code(cfg):
        raise refusal("the run's config", task)


@dataclass(frozen=True)
class EvalInputs:
    """What one evaluation reads: its task, data settings, rewards, the rows of its data source, and the
    tools and environments of its rollouts (None: single turns)."""

    task: Task
    data: DataConfig
    reward_funcs: RewardFuncs
    source: str
    rows: list[dict[str, Any]]
    agent: AgentSpec | None = None


def _inputs(
    cfg: Config | None,
    data: str | None,
    split: str,
    limit: int | None,
    rewards: tuple[str, ...],
    untrusted: bool,
) -> EvalInputs:
    """The task, data, rewards and tools of `cfg` (the default task's without one), `data` and `rewards`
    winning; the rows are read and the tools imported and checked here, before any model loads. An
    `untrusted` config (a run's, not granted) gives no rewards beyond leangrpo's own, and refuses tools."""
    data = data or (cfg.eval.path if cfg else None)
    if not data:
        raise EvalError(
            "give the evaluation data with --data (a .jsonl/.parquet file, a directory, or a hub id)"
        )
    task = load_task(cfg.task if cfg else TaskConfig())
    data_cfg = cfg.data if cfg else DataConfig(path=data, system_prompt=task.system_prompt)
    specs = cfg.rewards.functions if cfg else []
    if untrusted and cfg and (tools := tool_code(cfg)):
        raise refusal("the run's config", tools)
    if untrusted and (skipped := foreign_rewards(specs)):
        log.warning(
            "note: not scoring %s: the run's config names them, and code from a run runs only with %s "
            "(or name them with --reward or in your own -c)",
            ", ".join(skipped),
            TRUST_FLAG,
        )
        specs = [s for s in specs if s.name not in skipped]
    if rewards or not specs:
        specs = [RewardSpec(name=n) for n in rewards or task.default_rewards]
    source = resolve_data_path(data, split)
    rows = load_eval_rows(data_cfg, task, source, split, limit)
    agent = agent_from_config(cfg.tools) if cfg else None
    reward_funcs = load_rewards(specs, task) + (agent.environment_rewards() if agent else [])
    return EvalInputs(task, data_cfg, reward_funcs, source, rows, agent)


def _vllm_engine(
    lm: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    cfg: Config | None,
    max_model_len: int | None,
    dtype: str | None,
    seed: int,
    trust_remote_code: bool,
    processor: Any | None = None,
) -> RolloutEngine:
    """A vLLM engine that loads the checkpoint, then takes the weights evaluated (adapter merged); in
    `dtype`, by default the evaluated model's own (not vLLM's fp32 build). `processor`: a vision-language
    model's, which encodes image prompts for the scoring side (vLLM encodes them with its own)."""
    assert lm.name_or_path is not None, "from_pretrained sets it"
    share = cfg.grpo.vllm_gpu_memory_utilization if cfg else None
    dtype = dtype or str(lm.dtype).removeprefix("torch.")
    generator = VLLMEngine(
        lm.name_or_path, tokenizer, eos_token_ids(tokenizer, lm),
        max_model_len=max_model_len, dtype=dtype, seed=seed, trust_remote_code=trust_remote_code,
        gpu_memory_utilization=share or UNPLANNED_VLLM_SHARE, processor=processor,
    )  # fmt: skip
    generator.sync_weights(lm)
    return generator

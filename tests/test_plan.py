"""`leangrpo plan`: the memory formulas against exact counts from real (tiny) models, and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from click.testing import CliRunner

from leangrpo.cli import main
from leangrpo.commands import plan
from leangrpo.config.schema import GRPOSection, LoraConfig
from leangrpo.engines.hf import CACHE_KWARG, kv_cache, prefill_once_per_group
from leangrpo.engines.types import RolloutBatch
from leangrpo.models.load import apply_lora
from leangrpo.run.resolve import validate_config
from leangrpo.train.policy import Policy, micro_batch_logprobs, shared_prompt_group

KNOWN_TOTALS = {
    "Qwen/Qwen2.5-0.5B": 494_032_768,
    "Qwen/Qwen2.5-1.5B": 1_543_714_304,
    "Qwen/Qwen2.5-3B": 3_085_938_688,
    "Qwen/Qwen2.5-7B": 7_615_616_512,
    "meta-llama/Llama-3.2-1B": 1_235_814_400,
    "meta-llama/Llama-3.2-3B": 3_212_749_824,
    "meta-llama/Llama-3.1-8B": 8_030_261_248,
    "HuggingFaceTB/SmolLM2-135M": 134_515_008,
    "HuggingFaceTB/SmolLM2-360M": 361_821_120,
    "HuggingFaceTB/SmolLM2-1.7B": 1_711_376_384,
}
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


@pytest.mark.parametrize("name", list(KNOWN_TOTALS))
def test_builtin_shapes_match_published_parameter_totals(name):
    assert plan.resolve_shape(name).num_params() == KNOWN_TOTALS[name]


def tiny(kind: str, tied: bool = True, dtype=torch.float32, layers: int = 3):
    """A tiny random model of each modelled family (GQA, with/without biases and q/k norms)."""
    import transformers

    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[kind]
    torch.manual_seed(0)
    cfg = cfg_cls(
        vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied, head_dim=16,
    )  # fmt: skip
    model = model_cls(cfg).to(dtype)
    return model, plan.ModelShape.from_config(cfg.to_dict(), kind)


@pytest.mark.parametrize(
    ("kind", "tied"), [("llama", True), ("llama", False), ("qwen2", True), ("qwen3", False)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_param_count_and_weight_bytes_equal_a_real_model(kind, tied, dtype):
    model, shape = tiny(kind, tied, dtype)
    assert shape.num_params() == sum(p.numel() for p in model.parameters())
    knobs = plan.Knobs(dtype=DTYPES[dtype])
    assert plan.weight_bytes(shape, knobs) == sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize(
    ("targets", "r"), [("all-linear", 8), (["q_proj", "v_proj"], 4), (["down_proj"], 16)]
)
def test_lora_counts_and_dtype_equal_peft(targets, r):
    model, shape = tiny("qwen2", dtype=torch.bfloat16)
    peft_model = apply_lora(model, LoraConfig(enabled=True, r=r, target_modules=targets))
    trainable, total = peft_model.get_nb_trainable_parameters()
    knobs = plan.Knobs(method="lora", lora_r=r, lora_targets=plan.parse_targets(targets), dtype="bfloat16")
    assert plan.lora_params(shape, knobs) == trainable
    assert total == shape.num_params() + trainable
    adapter_bytes = sum(p.numel() * p.element_size() for p in peft_model.parameters() if p.requires_grad)
    assert trainable * plan.trainable_bytes_per_param(knobs) == adapter_bytes  # peft keeps adapters fp32


@pytest.mark.parametrize(
    ("method", "dtype"), [("full", torch.float32), ("full", torch.bfloat16), ("lora", torch.bfloat16)]
)
def test_adamw_state_bytes_equal_torch(method, dtype):
    model, shape = tiny("llama", tied=False, dtype=dtype)
    knobs = plan.Knobs(method=method, lora_r=4, dtype=DTYPES[dtype])
    if method == "lora":
        model = apply_lora(model, LoraConfig(enabled=True, r=4))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    state = sum(
        s[k].numel() * s[k].element_size() for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")
    )
    tensors = plan.trainable_tensors(shape, knobs)
    assert plan.optimizer_bytes(tensors, plan.trainable_bytes_per_param(knobs), "adamw") == state
    assert plan.estimate(shape, knobs).components["gradients"] == sum(
        p.numel() * p.element_size() for p in params
    )


def test_adamw_8bit_state_follows_bitsandbytes_layout():
    # bitsandbytes: fp32 states under 4096 values; else uint8 states + one fp32 absmax per 256 (rounded up).
    tensors = [("small", 1000), ("linear", 5000), ("linear", 4096)]
    expected = 1000 * 2 * 4 + 2 * (5000 + 4 * 20) + 2 * (4096 + 4 * 16)
    assert plan.optimizer_bytes(tensors, 2, "adamw_8bit") == expected


def test_kv_cache_is_the_cache_generation_preallocates():
    """hf.kv_cache's buffers, filled as the step fills them (a prefill per group, then generate()),
    hold what the plan's KV cache says: every row at the capacity kv_capacity gives."""
    model, shape = tiny("llama", dtype=torch.bfloat16)
    knobs = plan.Knobs(num_generations=2, per_device_train_batch_size=4, max_prompt_length=7,
                       max_completion_length=5)  # fmt: skip
    ids = torch.randint(0, 1000, (2, knobs.max_prompt_length)).repeat_interleave(2, 0)
    mask = torch.ones_like(ids)
    cache = kv_cache(model, ids.shape[1] + knobs.max_completion_length)  # as hf.generate sizes it
    prefill_once_per_group(model, ids, mask, knobs.num_generations, cache)
    new = knobs.max_completion_length
    model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                   pad_token_id=0, **{CACHE_KWARG: cache})  # fmt: skip
    real = sum(t.nbytes for layer in cache.layers for t in (layer.key_buffer, layer.value_buffer))
    assert plan.kv_cache_bytes(shape, knobs.generation_batch, plan.kv_capacity(knobs), 2) == real


def test_plan_defaults_are_the_configs_and_the_steps():
    """Knobs default to the config's defaults (dtype aside), the config's chunk size is the log-prob
    code's, and a dtype's bytes are torch's."""
    from leangrpo.core.logprobs import LOGPROB_CHUNK_SIZE
    from leangrpo.models.load import DTYPES as TORCH_DTYPES

    knobs = plan.Knobs()
    assert knobs.logprob_chunk_size == LOGPROB_CHUNK_SIZE
    cfg = validate_config({
        "model": {"name_or_path": "HuggingFaceTB/SmolLM2-135M", "dtype": "bfloat16"},
        "data": {"path": "x.jsonl"}, "rewards": {"functions": [{"name": "x"}]},
    })  # fmt: skip
    assert plan.knobs_from_config(cfg) == knobs
    assert {name: t.itemsize for name, t in TORCH_DTYPES.items()} == plan.DTYPE_BYTES


@pytest.mark.parametrize(
    ("batch", "group", "share"), [(8, 8, True), (4, 8, True), (6, 4, True), (8, 8, False)]
)
def test_shared_group_is_the_steps(batch, group, share):
    model, _ = tiny("llama")
    knobs = plan.Knobs(per_device_train_batch_size=batch, num_generations=group, share_prompt=share)
    step = (
        shared_prompt_group(model, batch, GRPOSection(num_generations=group))[0] if share else 1
    )  # as the Trainer picks it
    assert plan.shared_group(knobs) == step


def saved_tensor_bytes(
    model, batch: int, prompt: int, completion: int, group: int, packed: bool = False
) -> int:
    """Bytes autograd keeps for backward through the update's forward (distinct storages, weights
    excluded), with `group` completions sharing each prompt copy; `packed`: padding-free, the prompts
    without left padding (the plan's packed length counts every prompt token as real)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    prompts = torch.randint(0, 1000, (max(batch // 2, 1), prompt)).repeat_interleave(2, 0)[:batch]
    prompt_mask = torch.ones_like(prompts)
    if batch > 1 and not packed:
        prompt_mask[:2, :2] = 0  # left padding, as in a rollout batch
    completions = torch.randint(0, 1000, (batch, completion))
    ones = torch.ones_like(completions)
    rollout = RolloutBatch(prompts, prompt_mask, completions, ones, ones[:, 0].bool(), [""] * batch)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        policy = Policy(model.train(), 1.0, 1024, group > 1 or packed)
        micro_batch_logprobs(policy, rollout, slice(None), group=group, packed=packed)
    return sum(n for ptr, n in seen.items() if ptr not in params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("method", "dropout"), [("full", 0.0), ("lora", 0.05), ("lora", 0.0)])
@pytest.mark.parametrize(("group", "packed"), [(1, False), (2, False), (1, True), (2, True)])
def test_activation_formula_matches_tensors_saved_for_backward(dtype, method, dropout, group, packed):
    model, shape = tiny("qwen2", dtype=dtype, layers=4)
    if method == "lora":
        model = apply_lora(model, LoraConfig(enabled=True, r=4, dropout=dropout))
    batch, prompt, completion = 4, 7, 5
    knobs = plan.Knobs(method=method, lora_r=4, lora_dropout=dropout, dtype=DTYPES[dtype],
                       gradient_checkpointing=False, device="cpu")  # fmt: skip
    rows = plan.UpdateLayout.of(batch, prompt, completion, group, packed)
    predicted = plan.decoder_activation_bytes(shape, knobs, rows, batch * completion)
    saved = saved_tensor_bytes(model, batch, prompt, completion, group, packed)
    assert predicted == pytest.approx(saved, rel=0.02)


@pytest.mark.parametrize("batch", [1, 2])
def test_only_padded_micro_batches_save_an_attention_mask(batch):
    """One row is cropped to its own extent: no padding, so sdpa runs causal and no [B, 1, S, S] mask is
    kept for the backward (at 20K positions it would be 0.8 GB in bf16); rows with padding keep one. The
    plan counts the mask exactly then."""
    model, _ = tiny("llama", layers=2)
    prompt, completion = 40, 60
    squares = []

    def pack(t):
        if t.dim() == 4 and t.shape[-1] == t.shape[-2] == prompt + completion - 1:
            squares.append(t.shape)
        return t

    prompts = torch.randint(0, 1000, (batch, prompt))
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[1:, :2] = 0  # the second row, if any, left-padded as in a rollout batch
    completions = torch.randint(0, 1000, (batch, completion))
    ones = torch.ones_like(completions)
    rollout = RolloutBatch(prompts, prompt_mask, completions, ones, ones[:, 0].bool(), [""] * batch)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        micro_batch_logprobs(Policy(model.train(), 1.0, 1024, False), rollout, slice(None))
    assert bool(squares) == (batch > 1) == bool(plan.UpdateLayout.of(batch, prompt, completion).mask)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("24GB", 24 * 2**30), ("16 GiB", 16 * 2**30), ("8000MB", 8000 * 2**20), ("1.5g", int(1.5 * 2**30)),
     ("512", 512)],
)  # fmt: skip
def test_parse_memory(text, expected):
    assert plan.parse_memory(text) == expected


@pytest.mark.parametrize("text", ["lots", "24XB", "-3GB", "0GB", ""])
def test_parse_memory_rejects_garbage(text):
    with pytest.raises(plan.PlanError, match="cannot parse memory size"):
        plan.parse_memory(text)


def test_checkpointing_and_chunking_shrink_the_update_peak():
    shape = plan.resolve_shape("Qwen/Qwen2.5-0.5B")
    base = plan.Knobs(method="lora", gradient_checkpointing=True, logprob_chunk_size=1024)
    on, off = (
        plan.estimate(shape, base),
        plan.estimate(shape, plan.replace(base, gradient_checkpointing=False)),
    )
    assert on.components["activations"] < off.components["activations"] / 5
    small_chunks = plan.estimate(shape, plan.replace(base, logprob_chunk_size=128))
    assert small_chunks.components["log-prob workspace"] < on.components["log-prob workspace"] / 4
    # the reference copy appears only for full fine-tuning with beta > 0
    assert plan.estimate(shape, plan.replace(base, beta=0.04)).components["reference model"] == 0
    full_kl = plan.estimate(shape, plan.replace(base, method="full", beta=0.04))
    assert full_kl.components["reference model"] == full_kl.components["weights"]
    fp32 = plan.replace(base, method="full", beta=0.04, dtype="float32")
    bf16_ref = plan.estimate(shape, plan.replace(fp32, reference_dtype="bfloat16"))
    assert bf16_ref.components["reference model"] * 2 == plan.estimate(shape, fp32).components["weights"]


def test_fit_searches_g_then_completion_then_batch():
    shape = plan.resolve_shape("Qwen/Qwen2.5-1.5B")
    wanted = plan.Knobs(method="full", num_generations=16, per_device_train_batch_size=16,
                        max_completion_length=1024)  # fmt: skip
    memory = 24 * 2**30
    result = plan.search_fit(shape, wanted, memory, 0.1)
    k = result.knobs
    assert k is not None and plan.fits(result.estimate, memory, 0.1)
    assert k.generation_batch % k.num_generations == 0

    # every step of the search order is tight: one notch more no longer fits
    def too_big(**changes):
        return not plan.fits(plan.estimate(shape, plan.replace(k, **changes)), memory, 0.1)

    if k.num_generations < 16:
        assert too_big(
            num_generations=k.num_generations * 2,
            max_completion_length=32,
            per_device_train_batch_size=1,
            gradient_accumulation_steps=k.num_generations * 2,
        )
    if k.max_completion_length < 1024:
        assert too_big(
            max_completion_length=k.max_completion_length * 2,
            per_device_train_batch_size=1,
            gradient_accumulation_steps=k.generation_batch,
        )
    bigger = [b for b in range(k.per_device_train_batch_size + 1, 17) if k.generation_batch % b == 0]
    if bigger:
        assert too_big(
            per_device_train_batch_size=bigger[0], gradient_accumulation_steps=k.generation_batch // bigger[0]
        )


def test_fit_keeps_the_generation_buffer(gsm8k_dir):
    """With grpo.steps_per_generation, --fit keeps the generation (64 completions) and its 4 optimizer
    steps: the smaller micro-batch it finds takes more slices and accumulation, printed in its YAML."""

    def buffer(k):  # completions a generation, optimizer steps it makes
        slices = k.steps_per_generation or k.gradient_accumulation_steps
        return (
            k.per_device_train_batch_size * slices,
            slices * k.num_iterations // k.gradient_accumulation_steps,
        )

    shape = plan.resolve_shape("Qwen/Qwen2.5-1.5B")
    wanted = plan.make_knobs(
        num_generations=8, per_device_train_batch_size=8, gradient_accumulation_steps=2,
        steps_per_generation=8, max_completion_length=512, gradient_checkpointing=False,
    )  # fmt: skip
    assert buffer(wanted) == (64, 4)
    assert plan.search_fit(shape, wanted, 80 * 2**30, 0.1).knobs == wanted  # it fits as it is
    k = plan.search_fit(shape, wanted, 40 * 2**30, 0.1).knobs
    assert k is not None and k.num_generations == 8 and k.per_device_train_batch_size < 8
    assert buffer(k) == (64, 4)
    assert "(steps_per_generation 16: generation batch 64)" in plan.render(plan.estimate(shape, k), None, 0.1)
    snippet = yaml.safe_load(plan.yaml_snippet(k, "Qwen/Qwen2.5-1.5B"))
    snippet.update(data={"path": str(gsm8k_dir / "train.jsonl")}, rewards={"functions": [{"name": "x"}]})
    cfg = validate_config(snippet)
    assert (cfg.generation_batch_size, cfg.updates_per_step) == (64, 4)


def run_plan(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "leangrpo", "plan", *args],
        capture_output=True, text=True, env={**os.environ, **env}, timeout=120,
    )  # fmt: skip


def test_cli_fit_prints_a_yaml_snippet_that_validates(gsm8k_dir):
    res = CliRunner().invoke(
        main, ["plan", "--model", "Qwen/Qwen2.5-0.5B-Instruct", "--gpu-memory", "16GB", "--method", "lora",
               "-G", "16", "--completion-length", "1024", "--fit"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "predicted peak:" in res.output and "phase" in res.output
    for part in ("weights", "gradients", "optimizer state", "activations", "log-prob workspace", "KV cache"):
        assert part in res.output
    snippet = yaml.safe_load(res.output.split("that fits", 1)[1].split(":\n", 1)[1])
    snippet.update(data={"path": str(gsm8k_dir / "train.jsonl")}, rewards={"functions": [{"name": "x"}]})
    cfg = validate_config(snippet)  # pastes into a config as is
    assert cfg.model.lora.enabled and cfg.grpo.num_generations <= 16


def test_fit_of_qlora_on_vllm_validates_and_vllm_holds_the_dequantized_base(gsm8k_dir):
    """QLoRA with vLLM (issue 51): the --fit snippet pastes into a config (refused before), and the floor
    of vLLM's share counts the base as vLLM holds it, dequantized to model.dtype: LoRA's 16-bit weights."""
    res = CliRunner().invoke(
        main, ["plan", "--model", "Qwen/Qwen2.5-0.5B-Instruct", "--gpu-memory", "16GB", "--method",
               "qlora-4bit", "--rollout", "vllm", "--fit"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    snippet = yaml.safe_load(res.output.split("that fits", 1)[1].split(":\n", 1)[1])
    snippet.update(data={"path": str(gsm8k_dir / "train.jsonl")}, rewards={"functions": [{"name": "x"}]})
    cfg = validate_config(snippet)
    assert cfg.model.load_in_4bit and cfg.grpo.use_vllm
    shape, small = plan.resolve_shape("Qwen/Qwen2.5-0.5B-Instruct"), 2 * 2**30  # the floor decides
    shares = {
        m: plan.vllm_share(plan.estimate(shape, plan.make_knobs(method=m)), small)
        for m in ("lora", "qlora-4bit")
    }
    assert shares["qlora-4bit"] == shares["lora"] > shape.num_params() * 2 / small


def test_cli_takes_knobs_from_a_yaml_config(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(plan.BUILTIN_SHAPES["HuggingFaceTB/SmolLM2-135M"]))
    cfg = {
        "model": {"name_or_path": str(model_dir), "lora": {"enabled": True, "r": 8}},
        "data": {"path": "x.jsonl"},
        "rewards": {"functions": [{"name": "x"}]},
        "grpo": {"num_generations": 4, "max_completion_length": 48},
        "optim": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    res = CliRunner().invoke(main, ["plan", "--model", str(path), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert "method lora, float32" in res.output and "G=4, micro-batch 4 x 2" in res.output
    assert "completion 48 tokens" in res.output and "134.5M params" in res.output


def test_plan_does_not_import_torch():
    code = (
        "import sys; from leangrpo.cli import main\n"
        "try: main(['plan', '--model', 'HuggingFaceTB/SmolLM2-135M', '--gpu-memory', '8GB'])\n"
        "except SystemExit as e: assert e.code == 0, e.code\n"
        "assert 'torch' not in sys.modules"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_cli_unknown_model_offline_lists_builtin_shapes():
    proc = run_plan("--model", "nobody/no-such-model-xyz", "--gpu-memory", "24GB", HF_HUB_OFFLINE="1")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot read the config of model")
    assert "Qwen/Qwen2.5-1.5B" in lines[0] and "HuggingFaceTB/SmolLM2-135M" in lines[0]


def test_cli_bad_memory_string_is_one_line():
    proc = run_plan("--model", "Qwen/Qwen2.5-0.5B", "--gpu-memory", "twentyfour")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: cannot parse memory size 'twentyfour'; "
                                                "write it like 24GB, 16GiB or 8000MB"]  # fmt: skip


def test_cli_nothing_fits_says_what_dominates():
    res = CliRunner().invoke(
        main,
        ["plan", "--model", "meta-llama/Llama-3.1-8B", "--gpu-memory", "4GB", "--method", "full", "--fit"],
    )
    assert res.exit_code == 2
    assert "error: nothing fits in 4.00 GiB: even qlora-4bit with G=2" in res.output
    assert "dominated by weights" in res.output


def test_train_warns_when_the_plan_says_the_gpu_is_too_small(monkeypatch):
    cfg = validate_config({
        "model": {"name_or_path": "Qwen/Qwen2.5-7B", "dtype": "bfloat16"},
        "data": {"path": "x.jsonl"}, "rewards": {"functions": [{"name": "x"}]},
    })  # fmt: skip
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    class Props:
        total_memory = 24 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: Props)
    warning = plan.memory_startup_warning(cfg)
    assert warning and "predicted to need" in warning and "the GPU has 24.00 GiB" in warning
    Props.total_memory = 1024 * 2**30
    assert plan.memory_startup_warning(cfg) is None


def test_a_cpu_run_is_warned_against_the_ram_available(monkeypatch):
    """Without CUDA the plan (tensors + the process's runtime) is held against MemAvailable, in a
    one-process run only: the processes of a multi-process run share that RAM."""
    cfg = validate_config({
        "model": {"name_or_path": "HuggingFaceTB/SmolLM2-135M", "dtype": "float32"},
        "data": {"path": "x.jsonl"}, "rewards": {"functions": [{"name": "x"}]},
    })  # fmt: skip
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    est = plan.estimate(
        plan.resolve_shape("HuggingFaceTB/SmolLM2-135M"), plan.knobs_from_config(cfg, device="cpu")
    )
    need = est.total
    assert need == est.peak + plan.CPU_RUNTIME_BYTES
    monkeypatch.setattr(plan, "available_ram", lambda: need - 1)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    warning = plan.memory_startup_warning(cfg)
    assert warning and f"need {plan.fmt_bytes(need)}" in warning and "available" in warning, warning
    assert "--device cpu --memory" in warning
    advice = ["plan", "--model", "HuggingFaceTB/SmolLM2-135M", "--device", "cpu", "--memory", "1GB", "--fit"]
    res = CliRunner().invoke(main, advice)  # the command the warning names
    assert res.exit_code == 0 and "largest configuration that fits" in res.output, res.output
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert plan.memory_startup_warning(cfg) is None
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setattr(plan, "available_ram", lambda: need)
    assert plan.memory_startup_warning(cfg) is None


def test_available_ram_is_plausible():
    ram = plan.available_ram()
    assert ram is not None and 2**20 < ram < 2**50


def test_knobs_follow_the_config_rule_for_g():
    assert plan.make_knobs(num_generations=16, per_device_train_batch_size=8).gradient_accumulation_steps == 2
    with pytest.raises(plan.PlanError, match="must divide the generation batch"):
        plan.make_knobs(num_generations=6, per_device_train_batch_size=4, gradient_accumulation_steps=1)


def test_qlora_weights_are_nf4_linears_plus_dtype_rest():
    shape = plan.resolve_shape("meta-llama/Llama-3.1-8B")
    linear = sum(n for kind, n in shape.param_tensors() if kind == "linear")
    rest = shape.num_params() - linear  # embeddings, untied lm_head, norms stay in bf16
    expected = linear * (0.5 + 1 / 64) + rest * 2
    assert plan.weight_bytes(shape, plan.Knobs(method="qlora-4bit")) == pytest.approx(expected, rel=1e-3)


def test_vllm_rollout_reserves_its_share_instead_of_a_kv_cache():
    shape = plan.resolve_shape("Qwen/Qwen2.5-0.5B")
    memory = 24 * 2**30
    est = plan.plan_for(
        shape, plan.Knobs(method="lora", rollout="vllm", vllm_gpu_memory_utilization=0.3), memory
    )
    assert est.components["vllm reservation"] == int(0.3 * memory) and est.components["KV cache"] == 0
    assert "generation" not in est.phases
    assert est.total == est.peak + est.overhead + int(0.3 * memory)
    knobs = plan.Knobs(method="lora", rollout="vllm", vllm_gpu_memory_utilization=0.3)
    grpo = yaml.safe_load(plan.yaml_snippet(knobs, "m"))["grpo"]  # the config that trains what was planned
    assert grpo["use_vllm"] is True and grpo["vllm_gpu_memory_utilization"] == 0.3


def test_memory_options_of_the_config_are_planned():
    shape = plan.resolve_shape("Qwen/Qwen2.5-1.5B")
    base = plan.Knobs(method="full")
    offload = plan.estimate(shape, plan.replace(base, activation_offload=True))
    assert offload.components["activations"] == 0 < plan.estimate(shape, base).components["activations"]
    snippet = yaml.safe_load(
        plan.yaml_snippet(plan.replace(base, optimizer="adamw_8bit", activation_offload=True), "m")
    )
    assert snippet["optim"]["optimizer"] == "adamw_8bit" and snippet["model"]["activation_offload"] is True


def test_optimizer_in_backward_plans_one_gradient_at_a_time(gsm8k_dir):
    """optim.optimizer_in_backward: the optimizer step holds the largest tensor's gradient (SmolLM2's tied
    embedding), not all of them; the CLI flag, the config key and the pasted snippet agree, and the
    planner refuses accumulation as the config does."""
    shape = plan.resolve_shape("HuggingFaceTB/SmolLM2-135M")
    base = plan.Knobs(method="full", dtype="float32", device="cpu")
    usual, in_backward = (
        plan.estimate(shape, base),
        plan.estimate(shape, plan.replace(base, optimizer_in_backward=True)),
    )
    assert usual.components["gradients"] == shape.num_params() * 4
    assert in_backward.components["gradients"] == shape.embedding_numel() * 4
    assert in_backward.phases["update"] < usual.phases["update"]
    snippet = yaml.safe_load(plan.yaml_snippet(plan.replace(base, optimizer_in_backward=True), "m"))
    snippet.update(data={"path": str(gsm8k_dir / "train.jsonl")}, rewards={"functions": [{"name": "x"}]})
    cfg = validate_config(snippet)  # pastes into a config as is (clipping off, as it must be)
    assert cfg.optim.optimizer_in_backward and plan.knobs_from_config(cfg).optimizer_in_backward
    args = ["plan", "--model", "HuggingFaceTB/SmolLM2-135M", "--method", "full", "--optimizer-in-backward"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0 and "each freed once stepped" in res.output, res.output
    res = CliRunner().invoke(main, [*args, "--grad-accum", "2"])
    assert res.exit_code != 0 and "--grad-accum 1" in res.output


def test_shared_prompt_layout_is_planned_and_can_be_turned_off():
    shape = plan.resolve_shape("Qwen/Qwen2.5-0.5B")
    base = plan.Knobs(method="lora", max_prompt_length=512, max_completion_length=128)
    shared, per_row = plan.estimate(shape, base), plan.estimate(shape, plan.replace(base, share_prompt=False))
    # 8 rows of 512 + 128 against one 512-token prompt + 8 × 128: checkpointed layer inputs shrink ~3x.
    assert shared.components["activations"] < per_row.components["activations"] / 2.5
    assert plan.UpdateLayout.of(8, 512, 128, 8).tokens == 512 + 8 * 128
    assert plan.UpdateLayout.of(8, 512, 128, 1).tokens == 8 * (512 + 128 - 1)
    snippet = yaml.safe_load(plan.yaml_snippet(plan.replace(base, share_prompt=False), "m"))
    assert snippet["grpo"]["share_prompt"] is False
    res = CliRunner().invoke(main, ["plan", "--model", "Qwen/Qwen2.5-0.5B", "--no-share-prompt",
                                    "--method", "lora", "--prompt-length", "512",
                                    "--completion-length", "128"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert plan.fmt_bytes(per_row.components["activations"]) in res.output


def test_padding_free_is_planned_at_max_lengths_and_can_be_turned_off():
    """Packed (grpo.padding_free, on), the real lengths are unknown to the plan: it takes every prompt and
    completion at its maximum, and says so; a prompt per completion then has no [B, 1, S, S] mask."""
    shape = plan.resolve_shape("Qwen/Qwen2.5-0.5B")
    base = plan.Knobs(method="lora", max_prompt_length=512, max_completion_length=128, share_prompt=False)
    assert base.padding_free
    assert plan.UpdateLayout.of(8, 512, 128, 1, packed=True) == plan.UpdateLayout(
        8 * 640,
        8 * 640,
        8 * 640,
        0,
        True,  # one causal block per row
    )
    assert plan.UpdateLayout.of(8, 512, 128, 8, packed=True).tokens == 512 + 8 * 128
    packed, padded = plan.estimate(shape, base), plan.estimate(shape, plan.replace(base, padding_free=False))
    assert packed.components["activations"] < padded.components["activations"]
    snippet = yaml.safe_load(plan.yaml_snippet(plan.replace(base, padding_free=False), "m"))
    assert snippet["grpo"]["padding_free"] is False
    args = ["plan", "--model", "Qwen/Qwen2.5-0.5B", "--method", "lora", "--no-share-prompt"]
    for flag, activations in (("--padding-free", packed), ("--no-padding-free", padded)):
        res = CliRunner().invoke(main, [*args, flag, "--prompt-length", "512", "--completion-length", "128"])
        assert res.exit_code == 0, res.output
        assert plan.fmt_bytes(activations.components["activations"]) in res.output
        assert ("every completion taken at max length" in res.output) == (flag == "--padding-free")


def test_fsdp_plans_shards_per_process_and_the_gathered_model():
    """--fsdp N: persistent state ÷ N (the byte counts themselves are checked against a real 2-process
    FSDP2 step in test_fsdp), generation holds the whole model next to the shards, the CLI says so."""
    shape = plan.resolve_shape("Qwen/Qwen2.5-7B")
    one = plan.estimate(shape, plan.make_knobs(beta=0.04, master_weights=False))  # FSDP2 runs none
    four = plan.estimate(shape, plan.make_knobs(beta=0.04, fsdp=4, master_weights=False))
    for part in ("weights", "optimizer state", "reference model"):
        assert four.components[part] == pytest.approx(one.components[part] / 4, abs=1)
    assert four.components["FSDP gathered"] == one.components["weights"]
    assert four.peak < one.peak / 2
    assert four.phases["generation"] > one.components["weights"]  # the gathered model is there to generate
    res = CliRunner().invoke(main, ["plan", "--model", "Qwen/Qwen2.5-7B", "--fsdp=8", "--gpu-memory", "24G"])
    assert res.exit_code == 0 and "FSDP2 over 8 processes" in res.output, res.output
    res = CliRunner().invoke(main, ["plan", "--model", "Qwen/Qwen2.5-7B", "--fsdp", "2", "--optimizer",
                                    "adamw_8bit"])  # fmt: skip
    assert res.exit_code != 0 and "adamw_8bit" in res.output.strip().splitlines()[-1]


def test_fsdp_plans_bf16_full_fine_tuning_with_fp32_shards():
    """FSDP2's master weights (train/distributed.py): by default on a GPU the bf16 policy's shards,
    gradients and AdamW state are fp32 (÷ N), with no separate master copy, and generation gathers the
    model in bf16."""
    shape = plan.resolve_shape("Qwen/Qwen2.5-7B")
    one = plan.estimate(shape, plan.make_knobs(beta=0.04))  # one process: bf16 weights and fp32 masters
    four = plan.estimate(shape, plan.make_knobs(beta=0.04, fsdp=4))
    assert four.components["weights"] == pytest.approx(shape.num_params() * 4 / 4, abs=1)
    assert not four.components.get("fp32 master weights")
    assert four.components["optimizer state"] == pytest.approx(one.components["optimizer state"] / 4, abs=1)
    assert four.components["FSDP gathered"] == one.components["weights"]  # gathered in bf16
    off = plan.estimate(shape, plan.make_knobs(beta=0.04, fsdp=4, master_weights=False))
    assert off.components["weights"] == pytest.approx(shape.num_params() * 2 / 4, abs=1)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("pack_head", [True, False])
@pytest.mark.parametrize("lean", [True, False])
def test_packed_weights_are_the_copies_generation_packs(monkeypatch, tied, method, pack_head, lean):
    """The plan's 'packed weights' (CPU, float32) is what generation hands oneDNN to pack: the lean decode
    loop, or packed_linears for generate()."""
    from leangrpo.cpu.decode import lean_decoder, packed_linears

    model, shape = tiny("llama", tied)
    if method == "lora":
        model = apply_lora(model, LoraConfig(enabled=True, r=4))
    packed: list[int] = []
    pack = torch.ops.mkldnn._reorder_linear_weight

    def recording(weight, batch_hint):
        packed.append(weight.numel() * weight.element_size())
        return pack(weight, batch_hint)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", recording)
    if lean:
        assert lean_decoder(model, 2, pack_head) is not None
    else:
        with packed_linears(model, 2, pack_head):
            pass
    knobs = plan.Knobs(method=method, dtype="float32", device="cpu", packed_lm_head=pack_head)
    assert plan.packed_copy_bytes(shape, knobs) == sum(packed) > 0
    for unpacked in (dict(device="cuda"), dict(dtype="bfloat16"), dict(rollout="vllm"),
                     dict(packed_generation=False), dict(method="qlora-4bit")):  # fmt: skip
        assert plan.packed_copy_bytes(shape, plan.replace(knobs, **unpacked)) == 0


def test_reference_on_disk_is_planned_in_its_own_pass_only(gsm8k_dir):
    """grpo.reference_on_disk: the copy leaves the generation and update phases, not the reference
    pass; the config key, the CLI flag and the pasted snippet agree; a CUDA plan is refused in one line."""
    shape = plan.resolve_shape("HuggingFaceTB/SmolLM2-135M")
    base = plan.Knobs(method="full", dtype="float32", device="cpu", beta=0.04, reference_on_disk=False)
    memory, disk = (
        plan.estimate(shape, base),
        plan.estimate(shape, plan.replace(base, reference_on_disk=True)),
    )
    by_default = plan.replace(base, reference_on_disk=None)  # the default: on disk on CPU without FSDP
    assert plan.estimate(shape, by_default).phases == disk.phases
    for elsewhere in (dict(device="cuda"), dict(fsdp=2)):  # there in memory, as the trainer keeps it
        in_memory = plan.estimate(shape, plan.replace(base, **elsewhere)).phases
        assert plan.estimate(shape, plan.replace(by_default, **elsewhere)).phases == in_memory
    ref = memory.components["reference model"]
    assert ref == disk.components["reference model"] == shape.num_params() * 4
    assert disk.phases["generation"] == memory.phases["generation"] - ref
    assert disk.phases["update"] == memory.phases["update"] - ref
    assert disk.phases["reference"] == memory.phases["reference"]

    snippet = yaml.safe_load(
        plan.yaml_snippet(plan.replace(base, reference_on_disk=True, packed_lm_head=False), "m")
    )
    assert snippet["cpu"] == {"reference_on_disk": True, "packed_lm_head": False}
    snippet.update(data={"path": str(gsm8k_dir / "train.jsonl")}, rewards={"functions": [{"name": "x"}]})
    k = plan.knobs_from_config(validate_config(snippet), device="cpu")
    assert k.reference_on_disk and k.packed_generation and not k.packed_lm_head

    args = ["plan", "--model", "HuggingFaceTB/SmolLM2-135M", "--method", "full", "--dtype", "fp32",
            "--beta", "0.04", "--reference-on-disk"]  # fmt: skip
    res = CliRunner().invoke(main, [*args, "--device", "cpu"])
    assert res.exit_code == 0 and "resident in the reference phase only" in res.output, res.output
    assert "packed weights" in res.output
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2 and "plan it with --device cpu" in res.output, res.output
    res = CliRunner().invoke(main, [*args, "--method", "lora"])  # no copy: no effect, as in the trainer
    assert res.exit_code == 0 and "the adapter is disabled" in res.output, res.output


def test_train_on_cpu_prints_the_ram_warning_before_loading(tmp_path, gsm8k_dir):
    """End to end: Llama-3.1-8B's plan (a built-in shape) cannot fit this machine's RAM; the warning comes
    before the model load, which then fails offline in one line."""
    if (plan.available_ram() or 0) > 100 * 2**30:
        pytest.skip("this machine has the RAM the plan asks for (about 120 GiB)")
    proc = subprocess.run(
        [sys.executable, "-m", "leangrpo", "train", "model.name_or_path=meta-llama/Llama-3.1-8B",
         f"data.path={gsm8k_dir / 'train.jsonl'}", "rewards.functions=[{name: xmlcount_reward}]",
         f"output_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=120,
    )  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 2, proc.stderr
    assert lines[0].startswith("warning: plan: this run is predicted to need") and "available" in lines[0]
    assert lines[1].startswith("error: cannot load tokenizer")


def test_fsdp_with_vllm_plans_one_engine_per_process_and_a_layer_wise_sync():
    """--fsdp N --rollout vllm: no whole model gathered to generate (each process's engine holds its own
    copy, inside its reservation); the sync gathers the largest shard group, next to the shards."""
    shape, memory = plan.resolve_shape("Qwen/Qwen2.5-7B"), 80 * 2**30
    hf = plan.plan_for(shape, plan.make_knobs(beta=0.04, fsdp=8), memory)
    knobs = plan.make_knobs(beta=0.04, fsdp=8, rollout="vllm", vllm_gpu_memory_utilization=0.3)
    vllm = plan.plan_for(shape, knobs, memory)
    assert "FSDP gathered" not in vllm.components and "generation" not in vllm.phases
    assert vllm.components["vllm reservation"] == int(0.3 * memory)  # per process: the plan is per process
    gather = vllm.components["FSDP sync gather"]
    # the root group (embeddings and untied head: 2 of 15 GiB here) is the largest, not the whole model
    assert gather == plan.sync_gather_bytes(shape, vllm.knobs) < hf.components["FSDP gathered"] / 5
    shards = sum(vllm.components[c] for c in ("weights", "optimizer state", "reference model"))
    assert vllm.phases["sync"] == pytest.approx(shards + gather, abs=4)  # the shards and one group
    assert vllm.peak < hf.peak  # without the gathered model, the update bounds the run again
    lora = plan.sync_gather_bytes(shape, plan.make_knobs(method="lora", fsdp=8, rollout="vllm"))
    assert lora > gather  # one merged Linear weight on top
    res = CliRunner().invoke(main, ["plan", "--model", "Qwen/Qwen2.5-7B", "--fsdp", "8", "--rollout", "vllm",
                                    "--gpu-memory", "80G"])  # fmt: skip
    assert res.exit_code == 0 and "FSDP sync gather" in res.output and "phase sync" in res.output, res.output


@pytest.mark.parametrize("method", ["full", "lora"])
def test_async_rollouts_plan_the_snapshot_and_its_generation_during_the_update(method):
    shape = plan.resolve_shape("Qwen/Qwen2.5-0.5B")
    sync = plan.estimate(shape, plan.Knobs(method=method))
    est = plan.estimate(shape, plan.Knobs(method=method, async_rollouts=True))
    copy = est.components["rollout snapshot"]
    assert copy == (
        plan.weight_bytes(shape, plan.Knobs()) if method == "full" else sync.components["trainable params"]
    )
    generating = sum(sync.components[c] for c in ("KV cache", "generation workspace", "packed weights"))
    assert est.phases["generation"] == sync.phases["generation"] + copy
    assert (
        est.phases["update"] == sync.phases["update"] + copy + generating
    )  # the next batch generates meanwhile
    assert "rollout snapshot" not in sync.components
    knobs = plan.Knobs(method=method, async_rollouts=True)
    assert yaml.safe_load(plan.yaml_snippet(knobs, "m"))["grpo"]["async_rollouts"] is True


def test_several_gpus_and_bf16_full_fine_tuning_count_what_they_add():
    """--ddp N adds DDP's gradient buckets (a copy of every gradient, in every phase) and NCCL's buffers;
    bf16 full fine-tuning on a GPU adds the fp32 master copies (4 B/param) and keeps AdamW's state in
    fp32; the CUDA constants are printed as estimates (issue 53, item 11)."""
    shape = plan.resolve_shape("Qwen/Qwen2.5-0.5B")
    plain = plan.estimate(shape, plan.make_knobs(master_weights=False))
    two = plan.estimate(shape, plan.make_knobs(master_weights=False, ddp=2))
    grads = plan.resident(shape, plan.make_knobs()).grads
    assert two.components["DDP gradient buckets"] == grads > 0
    assert all(two.phases[p] == plain.phases[p] + grads for p in plain.phases)
    assert two.overhead - plain.overhead == plan.NCCL_BUFFER_BYTES + int(
        plan.ALLOCATOR_SLACK * two.peak
    ) - int(plan.ALLOCATOR_SLACK * plain.peak)
    masters = plan.estimate(shape, plan.make_knobs())  # bf16 full fine-tuning on a GPU: on by default
    n = shape.num_params()
    assert masters.components["fp32 master weights"] == 4 * n
    assert masters.components["optimizer state"] == 2 * plain.components["optimizer state"] == 8 * n
    assert plan.estimate(shape, plan.make_knobs(device="cpu")).components["fp32 master weights"] == 0
    res = CliRunner().invoke(
        main, ["plan", "--model", "Qwen/Qwen2.5-0.5B", "--ddp", "2", "--gpu-memory", "24G"]
    )
    assert res.exit_code == 0, res.output
    assert "DDP over 2 processes" in res.output and "DDP gradient buckets" in res.output
    assert "fp32 master weights" in res.output
    assert "+ NCCL buffers (estimates: CUDA context 512 MiB, allocator slack 8%, NCCL 256 MiB)" in res.output
    # one process has no NCCL buffers: its estimate line does not name them
    one = CliRunner().invoke(main, ["plan", "--model", "Qwen/Qwen2.5-0.5B", "--gpu-memory", "24G"])
    assert one.exit_code == 0, one.output
    assert "(estimates: CUDA context 512 MiB, allocator slack 8%)" in one.output and "NCCL" not in one.output


def test_the_pasted_config_adds_no_prompt_limit(tmp_path):
    """Without grpo.max_prompt_length (no limit: prompts are not cut) the plan assumes a prompt length,
    says so, and its pasted YAML sets no limit; a limit the config or --prompt-length sets is kept."""
    assert "max_prompt_length" not in yaml.safe_load(plan.yaml_snippet(plan.Knobs(), "m"))["grpo"]
    limited = plan.replace(plan.Knobs(), max_prompt_length=300)
    assert yaml.safe_load(plan.yaml_snippet(limited, "m"))["grpo"]["max_prompt_length"] == 300
    res = CliRunner().invoke(
        main, ["plan", "--model", "Qwen/Qwen2.5-0.5B-Instruct", "--gpu-memory", "16GB", "--method", "lora",
               "--fit"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert f"prompt {plan.ASSUMED_PROMPT_LENGTH} (assumed: no max_prompt_length" in res.output
    snippet = yaml.safe_load(res.output.split("that fits", 1)[1].split(":\n", 1)[1])
    assert "max_prompt_length" not in snippet["grpo"]


def test_a_null_vllm_share_is_what_the_plan_leaves_the_trainer():
    """grpo.vllm_gpu_memory_utilization null (the default): `leangrpo train` gives a colocated vLLM what
    the trainer's planned total leaves of the GPU, in hundredths, at most 0.9, writes it into the run's
    config and says so in one line; on a GPU too small for the trainer, at least vLLM's weights and KV
    cache (the start-up warning then says the run will not fit). A share that is set, HF rollouts, a
    server or no GPU leave the config as it is; a TRL config that leaves it unset keeps TRL's 0.3."""
    from leangrpo.config.trl import from_trl

    def cfg(**grpo):
        return validate_config({
            "model": {"name_or_path": "Qwen/Qwen2.5-1.5B", "dtype": "bfloat16", "lora": {"enabled": True}},
            "data": {"path": "d.jsonl"}, "rewards": {"functions": [{"name": "int"}]},
            "grpo": {"use_vllm": True, **grpo},
        })  # fmt: skip

    colocated, card = cfg(), 80 * 2**30
    assert colocated.grpo.vllm_gpu_memory_utilization is None
    trainer = plan.estimate(plan.resolve_shape("Qwen/Qwen2.5-1.5B"), plan.knobs_from_config(colocated)).total
    planned, line = plan.planned_vllm_share(colocated, card)
    share = planned.grpo.vllm_gpu_memory_utilization
    assert share == min(0.9, int(100 * (0.9 * card - trainer) / card) / 100) and 0.5 < share < 0.9
    assert line == (
        f"vLLM: grpo.vllm_gpu_memory_utilization {share:.2f} from the memory plan (the trainer is predicted "
        f"to need {plan.fmt_bytes(trainer)} of the GPU's {plan.fmt_bytes(card)}, 10% of it kept free; at "
        "most 0.9)"
    )
    assert plan.startup_warning(planned, card) is None  # trainer and engine fit the card together
    shape, knobs = plan.resolve_shape("Qwen/Qwen2.5-1.5B"), plan.knobs_from_config(colocated)
    assert plan.fits(plan.plan_for(shape, knobs, card), card, margin=0.1)  # so `plan --fit` finds fits
    small = 4 * 2**30  # below the trainer's own need: vLLM still gets its weights and cache
    tight, _ = plan.planned_vllm_share(colocated, small)
    assert tight.grpo.vllm_gpu_memory_utilization * small >= 1.5e9 * 2
    assert plan.startup_warning(tight, small).startswith("plan: this run is predicted to need")
    for unchanged, memory in ((cfg(vllm_gpu_memory_utilization=0.5), card), (cfg(use_vllm=False), card),
                              (cfg(vllm_mode="server"), card), (colocated, None)):  # fmt: skip
        assert plan.planned_vllm_share(unchanged, memory) == (unchanged, None)
    assert from_trl({"use_vllm": True}, "t.yaml")["grpo"]["vllm_gpu_memory_utilization"] == 0.3

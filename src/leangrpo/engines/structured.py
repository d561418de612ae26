"""Structured outputs on the HF engine: a logits processor that lets through only the tokens that keep a
completion inside a regex (`grpo.structured_outputs_regex`, TRL's `vllm_structured_outputs_regex`), as
vLLM's `StructuredOutputsParams(regex=...)` does. The automaton and the token masks are llguidance's (the
library behind vLLM's `guidance` backend; `pip install 'leangrpo[structured]'`)."""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from transformers import LogitsProcessor

from leangrpo.core.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class StructuredOutputsError(UserError, ValueError):
    """A tokenizer llguidance cannot read (a slow one)."""


class RegexConstraint(LogitsProcessor):
    """Sets to -inf every token that would take a row's completion out of `regex` (EOS only where the
    completion so far matches it whole). Each row's completion starts at the first call: it reads the
    token drawn at the step before from the last column of `input_ids` (generate()'s and the lean decode
    loop's), so it works after any prompt width. A row whose completion has ended (its EOS drawn) is left
    alone: generate() pads it. Put first among the processors, as vLLM applies its grammar mask before
    the penalties, the temperature and top-p, so that the sampler's log-probs are the masked
    distribution's (as vLLM's are)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, regex: str, eos: list[int]):
        from llguidance import LLMatcher

        self.tokenizer, self.eos = tokenizer, tuple(eos)
        self.grammar = LLMatcher.grammar_from_regex(regex)  # one the config checked
        self.matchers: list[Any] = []
        self.ended: list[bool] = []

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        from llguidance import LLMatcher

        if not self.matchers:
            tokenizer = ll_tokenizer(self.tokenizer, scores.shape[-1], self.eos)
            self.matchers = [LLMatcher(tokenizer, self.grammar) for _ in range(len(scores))]
            self.ended = [False] * len(scores)
        else:
            for row, token in enumerate(input_ids[:, -1].tolist()):
                if not self.ended[row]:
                    self.matchers[row].consume_token(token)
                    self.ended[row] = token in self.eos
        live = [row for row, ended in enumerate(self.ended) if not ended]
        if not live:
            return scores
        # each live row's mask, computed in parallel (a matcher whose regex can go no further allows EOS only)
        words = torch.full((len(scores), (scores.shape[-1] + 31) // 32), -1, dtype=torch.int32)
        executor(torch.get_num_threads()).unsafe_compute_mask_ptr(
            [(self.matchers[row], row) for row in live], words.data_ptr(), words.shape[1] * 4, len(words)
        )
        bits = (words[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1  # token 32·w + b: word w, bit b
        allowed = bits.flatten(1)[:, : scores.shape[-1]].bool()  # ended rows: all (-1)
        return scores.masked_fill(~allowed.to(scores.device), -torch.inf)


@lru_cache(maxsize=2)
def executor(threads: int) -> Any:
    """llguidance's pool that computes the rows' masks, with as many threads as torch uses."""
    from llguidance import LLExecutor

    return LLExecutor(threads)


@lru_cache(maxsize=4)
def ll_tokenizer(tokenizer: PreTrainedTokenizerBase, vocab: int, eos: tuple[int, ...]) -> Any:
    """llguidance's view of `tokenizer` over `vocab` logits, ending at any of `eos` (built once: about a
    second for a 50k vocabulary)."""
    from llguidance.hf import from_tokenizer
    from transformers import PreTrainedTokenizerFast

    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise StructuredOutputsError(
            f"grpo.structured_outputs_regex needs a fast tokenizer; {type(tokenizer).__name__} is not one"
        )
    return from_tokenizer(tokenizer, n_vocab=vocab, eos_token=list(eos))

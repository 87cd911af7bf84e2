"""Greedy agreement: generations with a compressed cache compared with the uncompressed cache's output for the
same prompts (DESIGN.md §4), by token-level match and ROUGE-L (Lin 2004, "ROUGE: A Package for Automatic
Evaluation of Summaries", via Google's ``rouge-score``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import lru_cache

from h2o_compress.config import CompressionConfig
from h2o_compress.utils.errors import InputError
from h2o_compress.runtime.generation import GenerationResult, generate
from h2o_compress.evaluation.corpus import load_prompts
from h2o_compress.evaluation.stream import ProgressFn
from h2o_compress.utils.checks import check_count


def token_match_rate(reference: list[int], candidate: list[int]) -> float:
    """Fraction of positions where both sequences hold the same token, over the longer length
    (``[1, 2, 3]`` vs ``[1, 5, 3, 4]`` -> 2/4). Two empty sequences match fully (1.0)."""
    longest = max(len(reference), len(candidate))
    if longest == 0:
        return 1.0
    return sum(a == b for a, b in zip(reference, candidate)) / longest


def prefix_match_rate(reference: list[int], candidate: list[int]) -> float:
    """Length of the common prefix over the reference length: how far greedy decoding agrees before it first
    diverges. An empty reference gives 1.0."""
    if not reference:
        return 1.0
    common = 0
    for a, b in zip(reference, candidate):
        if a != b:
            break
        common += 1
    return common / len(reference)


@lru_cache(maxsize=1)
def _rouge_scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def rouge_l(reference: str, candidate: str) -> float:
    """ROUGE-L F-measure of ``candidate`` against ``reference`` (``rouge-score``'s tokenizer: lower-cased
    alphanumeric words). Two texts with no words give 1.0; one empty side gives 0.0."""
    from rouge_score import tokenize

    if not tokenize.tokenize(reference, None) and not tokenize.tokenize(candidate, None):
        return 1.0
    return _rouge_scorer().score(reference, candidate)["rougeL"].fmeasure


@dataclass
class AgreementItem:
    """One prompt: both generations and their agreement."""

    prompt: str
    reference_text: str
    text: str
    token_match: float
    prefix_match: float
    rouge_l: float


@dataclass
class AgreementResult:
    """Per-prompt items and their means (``token_match``, ``prefix_match``, ``rouge_l``, each in [0, 1])."""

    config: dict
    max_new_tokens: int
    items: list[AgreementItem] = field(default_factory=list)

    def _mean(self, name: str) -> float:
        return sum(getattr(i, name) for i in self.items) / len(self.items) if self.items else float("nan")

    @property
    def token_match(self) -> float:
        return self._mean("token_match")

    @property
    def prefix_match(self) -> float:
        return self._mean("prefix_match")

    @property
    def rouge_l(self) -> float:
        return self._mean("rouge_l")

    def to_dict(self) -> dict:
        return {"config": self.config, "max_new_tokens": self.max_new_tokens, "token_match": self.token_match,
                "prefix_match": self.prefix_match, "rouge_l": self.rouge_l, "items": [asdict(i) for i in self.items]}


def compare(prompt: str, reference: GenerationResult, candidate: GenerationResult) -> AgreementItem:
    """Agreement of two generations of ``prompt`` (token ids and texts)."""
    return AgreementItem(
        prompt=prompt,
        reference_text=reference.text,
        text=candidate.text,
        token_match=token_match_rate(reference.token_ids, candidate.token_ids),
        prefix_match=prefix_match_rate(reference.token_ids, candidate.token_ids),
        rouge_l=rouge_l(reference.text, candidate.text),
    )


def reference_generations(model, tokenizer, prompts: list[str], max_new_tokens: int = 32,
                          progress: ProgressFn | None = None) -> list[GenerationResult]:
    """Greedy generations of ``prompts`` with the uncompressed cache (the reference of [`agreement_eval`][h2o_compress.evaluation.agreement_eval])."""
    results = []
    for i, prompt in enumerate(prompts):
        results.append(generate(model, tokenizer, prompt, CompressionConfig(policy="full"), max_new_tokens))
        if progress is not None:
            progress(i + 1, len(prompts))
    return results


def agreement_eval(
    model,
    tokenizer,
    config: CompressionConfig | None = None,
    prompts: list[str] | None = None,
    max_new_tokens: int = 32,
    references: list[GenerationResult] | None = None,
    progress: ProgressFn | None = None,
    compile: bool | None = None,
) -> AgreementResult:
    """Greedy generations of ``prompts`` (default: the shipped ones) with ``config``, compared with the
    uncompressed cache's. The budget fraction is relative to ``prompt + max_new_tokens`` (as in ``generate``).

    Args:
        references: uncompressed generations of the same prompts with the same ``max_new_tokens`` (computed
            when ``None``; pass them to reuse across settings).
        compile: decode steps through the compiled step (``None``: on with CUDA; see [`h2o_compress.generate`][h2o_compress.generate]).

    Raises:
        ConfigError: bad ``max_new_tokens`` or compression setting.
        InputError: no prompts, or ``references`` that do not match ``prompts``.
    """
    config = config or CompressionConfig()
    check_count("max_new_tokens", max_new_tokens)
    prompts = load_prompts() if prompts is None else [p for p in prompts if p and p.strip()]
    if not prompts:
        raise InputError("no prompt given; allowed: a list of non-empty prompts")
    if references is None:
        references = reference_generations(model, tokenizer, prompts, max_new_tokens)
    elif len(references) != len(prompts):
        raise InputError(f"{len(references)} reference generations for {len(prompts)} prompts; they must match")
    result = AgreementResult(config=config.to_dict(), max_new_tokens=max_new_tokens)
    for i, (prompt, reference) in enumerate(zip(prompts, references)):
        candidate = generate(model, tokenizer, prompt, config, max_new_tokens, compile=compile)
        result.items.append(compare(prompt, reference, candidate))
        if progress is not None:
            progress(i + 1, len(prompts))
    return result

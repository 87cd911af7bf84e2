"""Passkey retrieval (needle in a haystack): a sentence holding a random 5-digit number is planted at a
given depth of a long real text, and the model is asked for the number.

The prompt follows the passkey test of Mohtashami & Jaggi 2023 (Landmark Attention, arXiv 2305.16300 §4.2),
with real prose from the shipped corpus as the haystack instead of repeated filler sentences (as in
Kamradt's needle-in-a-haystack test). The answer is right when the first number the model writes is the
passkey. Every setting is compared with the uncompressed cache on the same prompts.
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass, field

import torch

from h2o_compress.runtime.chat import apply_chat_template
from h2o_compress.config import CompressionConfig
from h2o_compress.utils.errors import ConfigError, InputError, short
from h2o_compress.runtime.generation import check_generation_args, make_cache, make_scored_cache
from h2o_compress.evaluation.corpus import default_corpus
from h2o_compress.runtime.compiled import resolve_compile
from h2o_compress.evaluation.stream import ProgressFn, greedy_decode, model_device, read_stream, step_function
from h2o_compress.utils.checks import check_count, check_fraction
from h2o_compress.runtime.prefill import context_window

INSTRUCTION = (
    "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the pass key."
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key?"
ANSWER_PREFIX = "The pass key is"
# several passkeys in one haystack (``keys`` > 1): each numbered, asked for by its number
NUMBERED_NEEDLE = "Pass key number {n} is {key}. Remember it. {key} is pass key number {n}."
NUMBERED_QUESTION = "What is pass key number {n}?"
NUMBERED_ANSWER_PREFIX = "Pass key number {n} is"
MAX_KEYS = 10
PROTOCOLS = ("question-in-prompt", "compress-then-ask")
ANSWER_TOKENS = 8  # new tokens of each answer by default: room for a 5-digit passkey with any common tokenizer
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"']?\s+")


@dataclass
class NeedleTrial:
    """One retrieval: where the needle was, what the model said, and whether it was right.

    Attributes:
        setting: ``"compressed"`` or ``"reference"`` (uncompressed cache).
        length: requested context length (tokens); ``prompt_tokens`` is the exact prompt size.
        depth: position of the needle as a fraction of the haystack (0 = start, 1 = end).
    """

    setting: str
    length: int
    depth: float
    trial: int
    passkey: str
    prompt_tokens: int
    answer: str
    correct: bool
    kv_bytes: int
    key: int = 0  # with several passkeys in one haystack: which one was asked for (1-based); 0: the only one


@dataclass
class NeedleResult:
    """All trials plus accuracy per (setting, length, depth).

    Attributes:
        accuracy: ``{setting: {length: {depth: fraction correct}}}`` (JSON keys are strings).
    """

    config: dict
    trials: list[NeedleTrial] = field(default_factory=list)

    @property
    def accuracy(self) -> dict[str, dict[int, dict[float, float]]]:
        table: dict = {}
        for t in self.trials:
            cell = table.setdefault(t.setting, {}).setdefault(t.length, {}).setdefault(t.depth, [])
            cell.append(t.correct)
        return {setting: {n: {d: sum(c) / len(c) for d, c in row.items()} for n, row in rows.items()}
                for setting, rows in table.items()}

    @property
    def per_key(self) -> dict[str, dict[int, float]]:
        """``{setting: {key: fraction correct}}`` over every length and depth (several passkeys per haystack)."""
        table: dict = {}
        for t in self.trials:
            table.setdefault(t.setting, {}).setdefault(t.key, []).append(t.correct)
        return {s: {k: sum(c) / len(c) for k, c in sorted(keys.items())} for s, keys in table.items()}

    def overall(self, setting: str) -> float:
        """Fraction of correct answers of ``setting`` over every length and depth (``nan`` if none)."""
        marks = [t.correct for t in self.trials if t.setting == setting]
        return sum(marks) / len(marks) if marks else float("nan")

    def to_dict(self) -> dict:
        accuracy = {
            s: {str(n): {f"{d:g}": a for d, a in row.items()} for n, row in rows.items()}
            for s, rows in self.accuracy.items()
        }
        overall = {s: self.overall(s) for s in accuracy}
        out = {"config": self.config, "accuracy": accuracy, "overall": overall,
               "trials": [asdict(t) for t in self.trials]}
        if any(t.key for t in self.trials):
            out["per_key"] = {s: {str(k): a for k, a in keys.items()} for s, keys in self.per_key.items()}
        return out


def extract_answer(text: str) -> str | None:
    """The first run of digits in ``text`` (the model's answer), or ``None``."""
    match = re.search(r"\d+", text)
    return match.group(0) if match else None


def is_correct(text: str, passkey: str) -> bool:
    """True when the first number in ``text`` is exactly ``passkey`` (``"48213."`` yes, ``"482135"`` no)."""
    return extract_answer(text) == passkey


def plant_needle(haystack: str, needle: str, depth: float) -> str:
    """``haystack`` with ``needle`` inserted at the sentence boundary nearest ``depth`` (fraction in [0, 1]
    of the haystack's characters); depth 0 puts it first, depth 1 last.

    Raises:
        ConfigError: depth outside [0, 1].
    """
    check_fraction("depth", depth, allowed="a fraction in [0, 1]")
    bounds = [0] + [m.end() for m in _SENTENCE_END.finditer(haystack)] + [len(haystack)]
    target = depth * len(haystack)
    cut = min(bounds, key=lambda b: abs(b - target))
    before, after = haystack[:cut].rstrip(), haystack[cut:].lstrip()
    return " ".join(part for part in (before, needle, after) if part)


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def build_prompt(tokenizer, haystack: str, chat: bool = True, question: str = QUESTION,
                 answer_prefix: str = ANSWER_PREFIX) -> torch.Tensor:
    """Token ids ``[1, tokens]``: instruction + haystack + question, then ``answer_prefix`` (``"The pass key is"``)
    as the start of the answer (inside the assistant turn of the chat template when ``chat`` and the tokenizer has
    one)."""
    user = f"{INSTRUCTION}\n\n{haystack}\n\n{question}"
    if chat and getattr(tokenizer, "chat_template", None):
        ids = apply_chat_template(tokenizer, [{"role": "user", "content": user}], add_generation_prompt=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        ids += _encode(tokenizer, answer_prefix)
    else:
        ids = _encode(tokenizer, f"{user}\n{answer_prefix}")
    return torch.tensor([ids])


def make_haystack(tokenizer, corpus: str, tokens: int, offset: int = 0) -> str:
    """About ``tokens`` tokens of ``corpus`` from the first paragraph at or after character ``offset``, cut at
    a sentence end (or, when the last sentence end would lose more than 10% of the text, a word boundary)."""
    if offset > 0:
        start = corpus.find("\n\n", offset)
        offset = start + 2 if start >= 0 else 0
    text = corpus[offset : offset + 8 * tokens + 64]
    ids = _encode(tokenizer, text)[:tokens]
    text = tokenizer.decode(ids)
    ends = [m.start() + 1 for m in _SENTENCE_END.finditer(text)]
    if ends and ends[-1] >= 0.9 * len(text):
        return text[: ends[-1]].strip()
    return text[: text.rstrip().rfind(" ")].strip() if " " in text.strip() else text.strip()  # a word boundary


def needle_prompt(tokenizer, length: int, depth: float, passkey: str, corpus: str | None = None,
                  offset: int = 0, chat: bool = True) -> torch.Tensor:
    """The passkey prompt ``[1, ~length]`` with the needle at ``depth`` of a haystack from ``corpus``."""
    return needle_prompt_parts(tokenizer, length, depth, passkey, corpus, offset, chat)[0]


def needle_prompt_parts(tokenizer, length: int, depth: float, passkey: str, corpus: str | None = None,
                        offset: int = 0, chat: bool = True) -> tuple[torch.Tensor, int]:
    """`needle_prompt` and the number of its tokens before the question (instruction + haystack: what the
    compress-then-ask protocol compresses before the question is known)."""
    corpus = corpus or default_corpus()
    needle = NEEDLE.format(key=passkey)
    overhead = build_prompt(tokenizer, needle, chat).shape[1]
    haystack = plant_needle(make_haystack(tokenizer, corpus, max(length - overhead, 1), offset), needle, depth)
    ids = build_prompt(tokenizer, haystack, chat)
    other = build_prompt(tokenizer, haystack, chat, question="Which number was given?")  # another question
    n = min(ids.shape[1], other.shape[1])
    differs = (ids[0, :n] != other[0, :n]).nonzero()
    return ids, int(differs[0, 0]) if differs.numel() else n


def numbered_prompts(tokenizer, length: int, depth: float, passkeys: list[str], corpus: str | None = None,
                     offset: int = 0, chat: bool = True) -> list[tuple[torch.Tensor, int]]:
    """Several passkeys in one haystack of about ``length`` tokens: key ``n`` (1-based, of ``N``) is planted at depth
    ``(n - 1 + depth) / N`` (one per ``N``-th of the haystack, ``depth`` into it). Returns one ``(prompt [1, tokens],
    tokens before the question)`` per key, each asking for its key by number; the part before the question (what
    compress-then-ask compresses) is the same for all."""
    corpus, count = corpus or default_corpus(), len(passkeys)
    needles = [NUMBERED_NEEDLE.format(n=n, key=key) for n, key in enumerate(passkeys, start=1)]
    overhead = build_prompt(tokenizer, " ".join(needles), chat).shape[1]
    haystack = make_haystack(tokenizer, corpus, max(length - overhead, 1), offset)
    cuts = [round((n + depth) / count * len(haystack)) for n in range(count)]
    pieces, start = [], 0
    for cut, needle in zip(cuts, needles):
        pieces += [haystack[start:cut], needle]
        start = cut
    haystack = " ".join(p.strip() for p in [*pieces, haystack[start:]] if p.strip())
    prompts = [build_prompt(tokenizer, haystack, chat, NUMBERED_QUESTION.format(n=n),
                            NUMBERED_ANSWER_PREFIX.format(n=n)) for n in range(1, count + 1)]
    other = build_prompt(tokenizer, haystack, chat, question="Which number was given?")  # where the question starts
    n = min(prompts[0].shape[1], other.shape[1])
    differs = (prompts[0][0, :n] != other[0, :n]).nonzero()
    shared = int(differs[0, 0]) if differs.numel() else n
    return [(p, shared) for p in prompts]


@torch.inference_mode()
def answer_prompt(model, tokenizer, input_ids: torch.Tensor, config: CompressionConfig,
                  max_new_tokens: int = ANSWER_TOKENS, chunk_size: int | None = None, compile: bool | None = None,
                  context_tokens: int | None = None) -> tuple[str, int]:
    """Greedy answer to ``input_ids`` (``[1, tokens]``).

    Question in the prompt (``context_tokens`` ``None``): one cache built for ``tokens + max_new_tokens``.
    Compress-then-ask (``context_tokens`` = tokens before the question): the context alone goes through a cache
    built for it (the budget applies to the context), then the question and the answer go into its frozen copy
    ([`frozen_copy`][h2o_compress.CompressedCache.frozen_copy]: nothing more is evicted), as [`h2o_compress.runtime.ask`][h2o_compress.runtime.ask.ask]
    does. ``chunk_size`` ``None`` reads the prompt in one pass, as [`h2o_compress.generate`][h2o_compress.generate] does (eviction
    then acts after the prompt); a number reads it in chunks, so eviction acts while it is read. ``compile``:
    decode steps through the compiled step (``None``: on with CUDA).

    Returns:
        ``(answer_text, kv_bytes)`` (the bytes held at the end of the answer).
    """
    input_ids = input_ids.to(model_device(model))
    total = input_ids.shape[1] + max_new_tokens
    if context_tokens is None:
        if chunk_size is None:  # as generate() does (kvzip, lookahead: their pass over the whole prompt first)
            cache = make_scored_cache(model, tokenizer, input_ids, config, total, question_in_prompt=True)
        else:
            cache = make_cache(model, config, max_length=total)
    else:
        if chunk_size is None:  # as compress() does (kvzip, lookahead: scored by their pass first)
            context = make_scored_cache(model, tokenizer, input_ids[:, :context_tokens], config, context_tokens)
        else:
            context = make_cache(model, config, max_length=context_tokens)
        if context.seen_tokens() < context_tokens:
            read_stream(model, context, input_ids[:, :context_tokens], chunk_size)
        cache, input_ids = context.frozen_copy(total), input_ids[:, context_tokens:]
    step = step_function(model, resolve_compile(compile, cache, input_ids.device, model))
    if cache.seen_tokens() == input_ids.shape[1]:  # snapkv's pass laid the whole prompt in
        logits = cache.prompt_state.next_logits
    else:
        logits, _ = read_stream(model, cache, input_ids, chunk_size, decoder=step)
    ids, _ = greedy_decode(model, cache, logits, max_new_tokens, {tokenizer.eos_token_id}, step=step)
    return tokenizer.decode(ids, skip_special_tokens=True), cache.nbytes()


def check_needle_args(lengths, depths, trials: int = 1, max_new_tokens: int = ANSWER_TOKENS,
                      chunk_size: int | None = None, protocol: str = PROTOCOLS[0], seed: int | None = 0,
                      keys: int = 1) -> None:
    """Validate [`needle_eval`][h2o_compress.evaluation.needle_eval]'s arguments (those that do not need the model or its tokenizer: see
    `_check_model_fits` for the lengths and ``max_new_tokens`` against them). Raises ConfigError naming the bad one."""
    if protocol not in PROTOCOLS:
        raise ConfigError(f"protocol={short(protocol)} is not supported; allowed: {', '.join(PROTOCOLS)}")
    check_count("trials", trials, unit="trials per cell")
    check_count("keys", keys, unit="passkeys per haystack", maximum=MAX_KEYS)
    check_count("max_new_tokens", max_new_tokens)
    check_generation_args(max_new_tokens, 0.0, seed)  # the seed as generate checks it: an integer in [0, 2**64)
    if chunk_size is not None:
        check_count("chunk_size", chunk_size)
    if not lengths or not depths:
        raise ConfigError("lengths and depths must not be empty; allowed: e.g. lengths 512,1024 and depths 0,0.5,1")
    for length in lengths:
        check_count("length", length, minimum=64)
    for depth in depths:
        plant_needle("", "", depth)  # validates the depth


def passkey_tokens(tokenizer, passkey: str) -> int:
    """Tokens the model writes for ``passkey`` after `ANSWER_PREFIX` (with its leading space), with
    ``tokenizer``: the fewest new tokens in which a right answer fits."""
    prefix = _encode(tokenizer, ANSWER_PREFIX)
    answer = _encode(tokenizer, f"{ANSWER_PREFIX} {passkey}")
    if answer[: len(prefix)] == prefix:
        return len(answer) - len(prefix)
    return len(_encode(tokenizer, f" {passkey}"))


def needle_eval(
    model,
    tokenizer,
    config: CompressionConfig | None = None,
    lengths: tuple[int, ...] = (512, 1024),
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0),
    trials: int = 1,
    seed: int = 0,
    chunk_size: int | None = None,
    max_new_tokens: int = ANSWER_TOKENS,
    reference: bool = True,
    chat: bool = True,
    corpus: str | None = None,
    progress: ProgressFn | None = None,
    compile: bool | None = None,
    protocol: str = "question-in-prompt",
    keys: int = 1,
) -> NeedleResult:
    """Passkey accuracy per (context length, depth) for ``config`` and, with ``reference``, the uncompressed cache.

    Each (length, depth, trial) gets its own random 5-digit passkey and haystack offset (from ``seed``);
    both settings see identical prompts; ``corpus`` is the haystack's prose (default: the shipped corpus).
    ``protocol``: ``question-in-prompt`` (the budget fraction is relative to ``prompt + max_new_tokens``) or
    ``compress-then-ask`` (instruction + haystack compressed before the question is read, the budget relative to
    them; the question and the answer are added without eviction, as [`h2o_compress.runtime.ask`][h2o_compress.runtime.ask.ask] does).
    ``keys``: passkeys per haystack (1 to `MAX_KEYS`); above 1 they are numbered and spread over the
    haystack (`numbered_prompts`), each asked for in its own question from the same context, and
    [`NeedleResult.per_key`][h2o_compress.evaluation.NeedleResult.per_key] gives the accuracy per key.

    Raises:
        ConfigError: bad lengths, depths, trials, seed, chunk size or compression setting; ``max_new_tokens`` too
            few for the passkey with this tokenizer (`_check_model_fits`).
        InputError: a length beyond the model's context.
    """
    config = config or CompressionConfig()
    check_needle_args(lengths, depths, trials, max_new_tokens, chunk_size, protocol, seed, keys)
    corpus = corpus or default_corpus()
    cells = _draw_cells(lengths, depths, trials, keys, seed, len(corpus))
    _check_model_fits(model, tokenizer, lengths, {p for cell in cells for p in cell[3]}, max_new_tokens)
    settings = [("compressed", config)] + ([("reference", CompressionConfig(policy="full"))] if reference else [])
    result = NeedleResult(config={**config.to_dict(), "protocol": protocol, "keys": keys})
    total, done = len(cells) * len(settings) * keys, 0
    for length, depth, trial, passkeys, offset in cells:
        prompts = _cell_prompts(tokenizer, length, depth, passkeys, corpus, offset, chat)
        for key, (passkey, (prompt, split)) in enumerate(zip(passkeys, prompts), start=1 if keys > 1 else 0):
            context = split if protocol == "compress-then-ask" else None
            for name, setting in settings:
                answer, kv_bytes = answer_prompt(model, tokenizer, prompt, setting, max_new_tokens, chunk_size,
                                                 compile, context)
                result.trials.append(NeedleTrial(name, length, float(depth), trial, passkey, prompt.shape[1],
                                                 answer, is_correct(answer, passkey), kv_bytes, key))
                done += 1
                if progress is not None:
                    progress(done, total)
    return result


def _check_model_fits(model, tokenizer, lengths, passkeys, max_new_tokens: int) -> None:
    """Refuse a context length that, with ``max_new_tokens`` new tokens, exceeds ``model``'s context window
    (`context_window`; none: no limit), then ``max_new_tokens`` too few for the longest of ``passkeys`` with
    ``tokenizer`` (the answer would be cut before its last digit and scored wrong whatever the cache).

    Raises:
        InputError: naming the longest length allowed.
        ConfigError: naming the fewest new tokens the answer needs.
    """
    limit = context_window(model)
    for length in lengths:
        if limit and length + max_new_tokens > limit:
            raise InputError(f"length {length} + {max_new_tokens} new tokens exceeds the model's context of {limit}; "
                             f"allowed: lengths at most {limit - max_new_tokens} with max_new_tokens={max_new_tokens}")
    need, passkey = max((passkey_tokens(tokenizer, p), p) for p in passkeys)
    if max_new_tokens < need:
        raise ConfigError(f"max_new_tokens={max_new_tokens} is too few for the answer: the passkey {passkey} takes "
                          f"{need} tokens with this tokenizer, so it would be cut and scored wrong; allowed: "
                          f"max_new_tokens at least {need}")


def _draw_cells(lengths, depths, trials: int, keys: int, seed: int, corpus_chars: int) -> list[tuple]:
    """Every (length, depth, trial) of the grid with its random passkeys and haystack offset, all drawn first
    (from ``seed``, in grid order) so that the passkeys can be checked before anything runs.

    Args:
        keys: passkeys per haystack (5-digit texts).
        corpus_chars: the haystack corpus's length in characters (an offset leaves ``10 x length`` after it).

    Returns:
        ``(length, depth, trial, passkeys, offset)`` tuples.
    """
    rng = random.Random(seed)
    cells = []
    for length in lengths:
        for depth in depths:
            for trial in range(trials):
                passkeys = [str(rng.randint(10000, 99999)) for _ in range(keys)]
                cells.append((length, depth, trial, passkeys, rng.randrange(0, max(1, corpus_chars - 10 * length))))
    return cells


def _cell_prompts(tokenizer, length: int, depth: float, passkeys: list[str], corpus: str, offset: int,
                  chat: bool) -> list[tuple]:
    """One cell's prompts, one per passkey: `needle_prompt_parts` for a single key, `numbered_prompts` for
    several (numbered and spread over the haystack). Each is ``(prompt ids, split)``, ``split`` where the
    context ends."""
    if len(passkeys) == 1:
        return [needle_prompt_parts(tokenizer, length, depth, passkeys[0], corpus, offset, chat)]
    return numbered_prompts(tokenizer, length, depth, passkeys, corpus, offset, chat)

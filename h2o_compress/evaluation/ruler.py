"""RULER-style synthetic long-context tasks, generated locally (Hsieh et al. 2024, "RULER: What's the Real Context
Size of Your Long-Context Language Models?", arXiv 2404.06654 §3): needles in a haystack (single, multi-key,
multi-value, multi-query), variable tracking and common-words extraction, each scored as RULER scores them (the
share of the expected strings the answer contains), at the compression ratios of kvpress's leaderboard (the share
of the prompt's tokens removed: 0.25, 0.5, 0.75, 0.875).

The haystack of the needle tasks is RULER's noise ("The grass is green. The sky is blue. ..."), so no text of the
corpus is used and no setting is tuned on it; each sample is seeded, so every setting sees the same prompts.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import asdict, dataclass, field
from typing import Callable

from h2o_compress.config import CompressionConfig
from h2o_compress.runtime.generation import encode_prompt, generate
from h2o_compress.utils.checks import check_count, check_fraction
from h2o_compress.utils.errors import ConfigError, short

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
RATIOS = (0.25, 0.5, 0.75, 0.875)
#: kvpress's leaderboard compression ratios: the share of the prompt's KV cache removed.
WORDS = ("apple", "river", "stone", "cloud", "garden", "window", "silver", "forest", "candle", "bridge", "meadow",
         "harbor", "lantern", "copper", "valley", "feather", "thunder", "island", "marble", "shadow", "orchard",
         "planet", "saddle", "timber", "velvet", "whistle", "anchor", "blossom", "compass", "desert", "ember",
         "falcon", "glacier", "hollow", "ivory", "jasmine", "kettle", "lagoon", "mirror", "nectar")


@dataclass(frozen=True)
class RulerSample:
    """One generated prompt.

    Attributes:
        task: the task's name (a key of `TASKS`).
        context: the long part (haystack, assignments, word list).
        question: what is asked after it.
        answers: the strings a right answer contains (RULER's ``outputs``).
        max_new_tokens: tokens of the answer (RULER's per-task ``tokens_to_generate``).
    """

    task: str
    context: str
    question: str
    answers: tuple[str, ...]
    max_new_tokens: int

    @property
    def prompt(self) -> str:
        return f"{self.context}\n\n{self.question}"


def _number(rng: random.Random) -> str:
    return str(rng.randrange(1_000_000, 10_000_000))


def _key(rng: random.Random) -> str:
    return "-".join(rng.sample(WORDS, 2))


def _haystack(needles: list[str], sentences: int, rng: random.Random) -> str:
    """``sentences`` noise sentences with each needle at a random position."""
    parts = [NOISE] * sentences
    for needle in needles:
        parts.insert(rng.randrange(len(parts) + 1), needle + " ")
    return "".join(parts)


def _needle_task(name: str, keys: int, values: int, queries: int, tokens_to_generate: int = 32):
    """A needle task of RULER (§3, NIAH): ``keys`` distinct keys planted (``values`` numbers each), ``queries`` of
    them asked for; the answer must hold every value of the keys asked."""

    def make(size: int, rng: random.Random) -> RulerSample:
        chosen = []
        while len(chosen) < keys:
            key = _key(rng)
            if key not in chosen:
                chosen.append(key)
        numbers = {key: [_number(rng) for _ in range(values)] for key in chosen}
        needles = [f"One of the special magic numbers for {key} is: {n}." for key in chosen for n in numbers[key]]
        asked = chosen[:queries]
        context = _haystack(needles, size, rng)
        what = ", ".join(asked[:-1]) + (" and " if len(asked) > 1 else "") + asked[-1]
        question = (f"What are all the special magic numbers for {what} mentioned in the provided text? The special "
                    f"magic numbers for {what} mentioned in the provided text are")
        return RulerSample(name, "Some special magic numbers are hidden within the following text. Make sure to "
                           "memorize them. I will quiz you about the numbers afterwards.\n" + context, question,
                           tuple(n for key in asked for n in numbers[key]), tokens_to_generate * len(asked) * values)

    return make


def _variable_tracking(size: int, rng: random.Random) -> RulerSample:
    """RULER's variable tracking (§3, multi-hop): a chain ``VAR A = n``, ``VAR B = VAR A``, ... of 5 names hidden
    in noise; the answer must name every variable the chain assigns ``n``."""
    names = []
    while len(names) < 5:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in names:
            names.append(name)
    value = str(rng.randrange(10_000, 100_000))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    context = _haystack([], size, rng)
    parts = context.split(". ")
    spots = sorted(rng.sample(range(len(parts)), len(chain)))
    for spot, line in zip(reversed(spots), reversed(chain)):
        parts.insert(spot, line.rstrip("."))
    question = (f"Find all variables that are assigned the value {value} in the text above. Answer: According to the "
                f"chain(s) of variable assignment in the text above, {len(names)} variables are assigned the value "
                f"{value}, they are:")
    return RulerSample("vt", "Memorize and track the chain(s) of variable assignment hidden in the following text.\n"
                       + ". ".join(parts), question, tuple(names), 30)


def _made_up_word(rng: random.Random) -> str:
    return "".join(rng.choice("bcdfghklmnprstvz") + rng.choice("aeiou") for _ in range(3))


def _common_words(size: int, rng: random.Random) -> RulerSample:
    """RULER's common words extraction (§3, aggregation): a numbered list of ``size`` words where 10 words appear
    ``size / 40`` times each (4 to 30, RULER's 30 at long lengths) and the others 3 times; the answer must name the
    10 frequent words."""
    frequent, times = rng.sample(WORDS, 10), max(4, min(30, size // 40))
    words = [w for w in frequent for _ in range(times)]
    total = max(size, len(words) + 3)
    while len(words) < total:  # made-up rare words, 3 times each
        words += [_made_up_word(rng)] * 3
    rng.shuffle(words)
    listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
    question = ("What are the 10 most common words in the above list? Answer: The top 10 words that appear most often "
                "in the list are:")
    return RulerSample("cwe", "Below is a numbered list of words. In these words, some appear more often than others. "
                       "Memorize the ones that appear most often.\n" + listing, question, tuple(frequent), 120)


#: The tasks by name: ``(noise sentences or list size, rng) -> RulerSample`` (RULER §3: retrieval, multi-hop
#: tracing, aggregation).
TASKS: dict[str, Callable[[int, random.Random], RulerSample]] = {
    "niah_single": _needle_task("niah_single", 1, 1, 1),
    "niah_multikey": _needle_task("niah_multikey", 4, 1, 1),
    "niah_multivalue": _needle_task("niah_multivalue", 1, 4, 1, 16),
    "niah_multiquery": _needle_task("niah_multiquery", 4, 1, 4, 16),
    "vt": _variable_tracking,
    "cwe": _common_words,
}


def make_sample(task: str, tokens: int, seed: int, count_tokens: Callable[[str], int]) -> RulerSample:
    """The ``seed``-th sample of ``task`` sized to about ``tokens`` tokens (``count_tokens`` counts a text's),
    by bisection on the haystack's size.

    Raises:
        ConfigError: an unknown task.
    """
    if task not in TASKS:
        raise ConfigError(f"task {short(task)} is not a RULER task here; allowed: {', '.join(TASKS)}")
    low, high = 1, max(2, tokens // 4)
    while low < high:  # the largest size whose prompt stays within the tokens
        middle = (low + high + 1) // 2
        if count_tokens(TASKS[task](middle, random.Random(seed)).prompt) <= tokens:
            low = middle
        else:
            high = middle - 1
    return TASKS[task](low, random.Random(seed))


def score(answer: str, sample: RulerSample) -> float:
    """RULER's ``string_match_all``: the share of ``sample.answers`` found in ``answer`` (case-insensitive)."""
    text = answer.lower()
    return sum(expected.lower() in text for expected in sample.answers) / len(sample.answers)


@dataclass
class RulerResult:
    """Scores per (setting, task), each the mean over samples of `score`.

    Attributes:
        length: the prompts' length (tokens).
        scores: ``{setting: {task: score in [0, 1]}}``; a setting is ``"uncompressed"`` or ``"<policy> <ratio>"``.
        kv_share: ``{setting: KV bytes after the answer / the uncompressed fp16 cache's}``.
    """

    length: int
    scores: dict = field(default_factory=dict)
    kv_share: dict = field(default_factory=dict)

    def mean(self, setting: str) -> float:
        """The setting's score averaged over the tasks."""
        values = list(self.scores[setting].values())
        return sum(values) / len(values)

    def to_dict(self) -> dict:
        return asdict(self) | {"means": {s: self.mean(s) for s in self.scores}}


def check_ruler_args(tasks, ratios, samples: int, length: int) -> None:
    """Refuse an unknown task, a ratio outside [0, 1), a sample count below 1 or a length below 256 tokens.

    Raises:
        ConfigError: naming the value and what is allowed.
    """
    for task in tasks:
        if task not in TASKS:
            raise ConfigError(f"task {short(task)} is not a RULER task here; allowed: {', '.join(TASKS)}")
    for ratio in ratios:
        check_fraction("ratio", ratio, include_high=False,
                       allowed=f"a share of the prompt removed in [0, 1), e.g. {','.join(map(str, RATIOS))}")
    check_count("samples", samples)
    check_count("length", length, minimum=256)


def ruler_eval(model, tokenizer, policies, ratios=RATIOS, tasks=tuple(TASKS), samples: int = 3, length: int = 4096,
               base: CompressionConfig | None = None, reference: bool = True, progress=None) -> RulerResult:
    """Run every task's ``samples`` prompts of about ``length`` tokens through ``generate`` (greedy, chat template)
    uncompressed (``reference``) and under each policy at each compression ratio: the budget is ``(1 - ratio)`` of
    the prompt's tokens, in tokens (no floor), the rest of the setting ``base``'s (default: 4-bit keys and values).

    Args:
        policies: policy names (`h2o_compress.policies.POLICIES`).
        ratios: shares of the prompt's tokens removed, in [0, 1).
        progress: ``progress(done, total)`` after each generation, or ``None``.

    Raises:
        ConfigError: a bad task, ratio, count or length (`check_ruler_args`), or policy.
    """
    check_ruler_args(tasks, ratios, samples, length)
    base = base or CompressionConfig(kv_bits=4)
    count = lambda text: encode_prompt(tokenizer, text, True).shape[1]  # noqa: E731
    prompts = [make_sample(task, length, seed, count) for task in tasks for seed in range(samples)]
    settings = ([("uncompressed", CompressionConfig(policy="full"), None)] if reference else []) + [
        (f"{policy} {ratio:g}", dataclasses.replace(base, policy=policy), ratio) for policy in policies
        for ratio in ratios]
    result, done, total = RulerResult(length), 0, len(settings) * len(prompts)
    for name, config, ratio in settings:
        marks, shares = {}, []
        for sample in prompts:
            tokens = count(sample.prompt)
            run = config if ratio is None else dataclasses.replace(config, budget=max(1, round((1 - ratio) * tokens)))
            out = generate(model, tokenizer, sample.prompt, run, max_new_tokens=sample.max_new_tokens)
            marks.setdefault(sample.task, []).append(score(out.text, sample))
            shares.append(out.kv_bytes / out.kv_bytes_full_fp16)
            done += 1
            if progress is not None:
                progress(done, total)
        result.scores[name] = {task: sum(m) / len(m) for task, m in marks.items()}
        result.kv_share[name] = sum(shares) / len(shares)
    return result

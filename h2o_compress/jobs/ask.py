"""``h2o-compress ask`` as Python calls: [`AskJob`][h2o_compress.jobs.AskJob] checks every setting when it is made (nothing is loaded or
written before all are known to be good); [`AskJob.start`][h2o_compress.jobs.AskJob.start] loads the model and compresses (or loads) the
context once, giving an [`AskSession`][h2o_compress.jobs.AskSession] whose [`answer`][h2o_compress.jobs.AskSession.answer] answers one question from it;
[`run_ask`][h2o_compress.jobs.run_ask] does all of it for a list of questions.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import h2o_compress.runtime.ask as asking
from h2o_compress.config import CompressionConfig
from h2o_compress.utils.checks import check_threads
from h2o_compress.jobs.checks import CacheRunFields
from h2o_compress.models import DEFAULT_MODEL
from h2o_compress.persistence import check_cache_paths
from h2o_compress.runtime.chat import check_text_fits
from h2o_compress.runtime.generation import ON_TEXT, GenerationResult, check_config, check_prompt, encode_prompt
from h2o_compress.runtime.prefill import check_context, context_window
from h2o_compress.utils.checks import check_callback
from h2o_compress.utils.defaults import default_of
from h2o_compress.utils.errors import ConfigError, InputError, short
from h2o_compress.utils.files import MAX_TEXT_BYTES, read_text
from h2o_compress import models
from h2o_compress.models.weights import floating_dtype
from h2o_compress.utils.progress import ProgressFn, report_progress


@dataclass
class AskJob(CacheRunFields):
    """Compress-then-ask from a model named by path or alias, checked when made.

    Attributes:
        questions: the questions (each answered from the same compressed context); a single str is one question.
        context: the document text; or ``context_file``: a UTF-8 text file holding it (one of the two).
        model: alias, local model directory or hub id ([`h2o_compress.load_model`][h2o_compress.load_model]).
        config: the compression setting (default [`ASK_DEFAULTS`][h2o_compress.runtime.ask.ASK_DEFAULTS]).
        max_new_tokens: tokens per answer at most; chat, temperature, seed, compile: as for [`h2o_compress.ask`][h2o_compress.ask].
        save_cache: a file to save the compressed context to (an existing file must be a cache file unless
            ``overwrite``); load_cache: a compressed context saved that way (same document), instead of compressing.
        given: the settings asked for explicitly (e.g. the command line's flags): a loaded context's setting must
            match them.
        load: keyword arguments of [`h2o_compress.load_model`][h2o_compress.load_model] (``device``, ``dtype``, ``weights_bits``, ...).
        threads: torch CPU threads set before loading (``None``: torch's default).
        trust_remote_code: let the model directory run its own code.

    Raises (when made):
        InputError: a context file that cannot be read, an empty context or question, or one that is not UTF-8;
            no question at all, or questions that are not a text or a list of texts.
        ModelLoadError: ``model`` is not a non-empty text.
        ConfigError: bad ``max_new_tokens``/``temperature``/``seed``/``compile``/``threads``, both ``context`` and
            ``context_file`` (or neither), ``save_cache`` with ``load_cache``; a switch (``chat``, ``overwrite``,
            ``trust_remote_code``) that is not a bool; a ``load`` that ``load_model`` would refuse.
        CacheFileError: a ``save_cache`` that cannot be written, or a ``load_cache`` that is not a cache file.
    """

    questions: Sequence[str]
    context: str | None = None
    context_file: str | Path | None = None
    model: str = DEFAULT_MODEL
    config: CompressionConfig | None = None
    max_new_tokens: int = default_of(asking.ask, "max_new_tokens")
    chat: bool = default_of(asking.compress, "chat")
    temperature: float = default_of(asking.ask, "temperature")
    seed: int | None = None
    compile: bool | None = None

    def __post_init__(self) -> None:
        if (self.context is None) == (self.context_file is None):
            raise ConfigError("give the document as context (text) or as context_file (a path), one of the two")
        if self.context_file is not None:
            self.context = read_text(self.context_file, "context file", InputError, limit=MAX_TEXT_BYTES)
            if not self.context.strip():
                raise InputError(f"context file {short(str(self.context_file))} is empty (or whitespace only); "
                                 "allowed: a document to ask about")
        check_prompt(self.context)
        self.questions = question_list(self.questions)
        self._validate_shared()
        self.config = asking.ASK_DEFAULTS if self.config is None else check_config(self.config)
        self.request = self._generation_request()  # max_new_tokens, temperature, seed, chat, compile: not per answer
        if self.save_cache is not None and self.load_cache is not None:
            raise ConfigError("--save-cache and --load-cache cannot be combined: a loaded context is already saved")
        check_cache_paths(self.save_cache, self.load_cache, self.overwrite)
        check_threads(self.threads)

    def _fits(self, lm, tokenizer) -> None:
        """The request against the loaded model, before the context is tokenized, scored or loaded (minutes for a
        long one): attention layers only (`check_attention_only`), and the context + each question +
        ``max_new_tokens`` within the model's window ([`ask`][h2o_compress.runtime.ask.ask] checks the same per
        question, later). Tokenizes only.

        Raises:
            UnsupportedModelError: a hybrid model.
            InputError: naming the question, the token counts and the most ``max_new_tokens`` that fits; a context
                or a question too long for the window whatever the tokenization (from its length, before
                tokenizing: `check_text_fits`).
        """
        asking.check_attention_only(lm)
        window = context_window(lm)
        check_text_fits(tokenizer, self.context, window, "the context")
        for question in self.questions:
            check_text_fits(tokenizer, question, window, f"question {short(question, 60)}")
            total = encode_prompt(tokenizer, self.context + asking.SEPARATOR + question, self.chat, window).shape[1]
            try:
                check_context(lm, total, self.max_new_tokens)
            except InputError as exc:
                raise InputError(f"context + question {short(question)}: {exc}") from None

    def start(self, on_progress: ProgressFn | None = None) -> "AskSession":
        """Load the model, refuse a question that cannot fit, then compress the context (or load it) and save it.

        Args:
            on_progress: receives ``(stage, done, total)`` while the model is converted on its first use, the
                context is scored and its compressed prefill runs
                ([`compress`][h2o_compress.runtime.ask.compress]); ``None``: the callback of an enclosing
                `report_progress` (`h2o_compress.utils.progress`), if any. Nothing is printed.

        Returns:
            An [`AskSession`][h2o_compress.jobs.AskSession] holding the compressed context and its figures.

        Raises:
            ModelLoadError: the model cannot be loaded.
            InputError: context + a question + ``max_new_tokens`` beyond the model's window (before compressing),
                or a loaded context that is not this document.
            UnsupportedModelError: a hybrid model (``h2o_compress.runtime.ask.check_attention_only``).
            ConfigError, CacheFileError, CacheStateError: see [`h2o_compress.compress`][h2o_compress.compress] and
                [`load`][h2o_compress.runtime.ask.CompressedContext.load] / ``save``.
        """
        import torch

        if self.threads is not None:
            torch.set_num_threads(self.threads)
        with nullcontext() if on_progress is None else report_progress(on_progress):
            lm, tokenizer = models.load_model(self.model, trust_remote_code=self.trust_remote_code, **self.load)
            self._fits(lm, tokenizer)  # before minutes of compressing the context
            started = time.perf_counter()  # before minutes of compressing, above
            if self.load_cache is not None:
                compressed = asking.CompressedContext.load(self.load_cache, lm, tokenizer, self.context, self.chat,
                                                           config=self.given)
            else:
                compressed = asking.compress(lm, tokenizer, self.context, self.config, chat=self.chat)
            context_s = time.perf_counter() - started
        if self.save_cache is not None:
            compressed.save(self.save_cache, overwrite=self.overwrite)
        cache = compressed.cache
        figures = {
            "model": self.model, "config": cache.config.to_dict(), "context_tokens": compressed.tokens,
            "context_kv_bytes": cache.nbytes(), "context_kv_bytes_full_fp16": cache.full_fp16_nbytes(),
            "capacity": cache.capacity, ("cache_load_s" if self.load_cache else "compress_s"): context_s,
        }
        return AskSession(self, lm, tokenizer, compressed, figures, str(floating_dtype(lm)).removeprefix("torch."))


@dataclass
class AskSession:
    """A loaded model and a compressed context, from [`AskJob.start`][h2o_compress.jobs.AskJob.start].

    Attributes:
        job: the [`AskJob`][h2o_compress.jobs.AskJob] (its generation settings apply to every answer).
        model: the loaded LM.
        tokenizer: its tokenizer.
        context: the [`CompressedContext`][h2o_compress.runtime.ask.CompressedContext] (never changed by [`answer`][h2o_compress.jobs.AskSession.answer]).
        figures: what ``ask --json`` prints before its answers: ``model``, ``config``, ``context_tokens``,
            ``context_kv_bytes``/``context_kv_bytes_full_fp16`` (bytes), ``capacity`` (tokens per layer and KV
            head) and ``compress_s`` or ``cache_load_s`` (seconds).
        kv_dtype: the floating dtype of the model (the 16-bit storage of the cache), e.g. ``float32``.
    """

    job: AskJob
    model: object
    tokenizer: object
    context: asking.CompressedContext
    figures: dict
    kv_dtype: str

    def answer(self, question: str, on_text: Callable[[str], None] | None = None) -> dict:
        """Answer ``question`` from the compressed context ([`h2o_compress.ask`][h2o_compress.ask]); ``on_text`` receives each new
        piece of text (streaming).

        Returns:
            The figures of ``ask --json``'s answer: the [`GenerationResult`][h2o_compress.runtime.generation.GenerationResult] fields but ``token_ids``, and
            ``question``.

        Raises:
            InputError: empty question, or context + question + new tokens beyond the model's window.
        """
        check_callback("on_text", on_text, ON_TEXT)
        check_prompt(question)
        return _answer_figures(self._generate(question, on_text), question)

    def _generate(self, question: str, on_text=None) -> GenerationResult:
        """The answer to a checked ``question`` (the job checked the generation settings when it was made)."""
        job = self.job
        return asking.ask_checked(self.model, self.tokenizer, self.context, question, job.request, on_text)


def question_list(questions) -> list[str]:
    """``questions`` as a list of checked texts: a single text is one question.

    Raises:
        InputError: not a text or a list (or tuple) of texts, an empty list, or a question that is empty or not
            UTF-8.
    """
    if isinstance(questions, str):
        questions = [questions]
    if not isinstance(questions, (list, tuple)):
        raise InputError(f"questions={short(questions)} is a {type(questions).__name__}; allowed: a question (a str) "
                         "or a list of them")
    if not questions:
        raise InputError("questions is empty: there is nothing to answer; allowed: at least one question")
    for text in questions:
        check_prompt(text)
    return list(questions)


def _answer_figures(result: GenerationResult, question: str) -> dict:
    figures = {k: v for k, v in result.to_dict().items() if k != "token_ids"}
    figures["question"] = question
    return figures


@dataclass
class AskReport:
    """What [`run_ask`][h2o_compress.jobs.run_ask] returns.

    Attributes:
        context: the compressed context's figures (`AskSession.figures`).
        answers: one figures dict per question ([`AskSession.answer`][h2o_compress.jobs.AskSession.answer]), ``text`` the answer.
        results: the [`GenerationResult`][h2o_compress.runtime.generation.GenerationResult] of each answer (token ids included).
    """

    context: dict
    answers: list[dict]
    results: list[GenerationResult]

    def to_dict(self) -> dict:
        """The object ``ask --json`` prints: the context's figures and ``answers``."""
        return {**self.context, "answers": list(self.answers)}


def run_ask(questions: Sequence[str] | str, context: str | None = None, context_file: str | Path | None = None,
            model: str = DEFAULT_MODEL, config: CompressionConfig | None = None,
            on_text: Callable[[str], None] | None = None, on_progress: ProgressFn | None = None,
            **settings) -> AskReport:
    """What ``h2o-compress ask`` runs: the document compressed once (or loaded), then each question answered from it.

    Args:
        questions: the questions (a single str is one).
        context: the document text (or give ``context_file``).
        context_file: a UTF-8 file holding the document (instead of ``context``).
        model: alias, local model directory or hub id.
        config: the compression setting (default [`ASK_DEFAULTS`][h2o_compress.runtime.ask.ASK_DEFAULTS]).
        on_text: receives each new piece of each answer (streaming).
        on_progress: receives the progress of the model's conversion and of the compression
            ([`AskJob.start`][h2o_compress.jobs.AskJob.start]).
        settings: the other fields of [`AskJob`][h2o_compress.jobs.AskJob] (``max_new_tokens`` in tokens per answer,
            ``save_cache``/``load_cache`` paths, ``load``, ...).

    Returns:
        An [`AskReport`][h2o_compress.jobs.AskReport] (``.answers[i]["text"]``, ``.to_dict()``).

    Raises:
        H2OCompressError: the errors of [`AskJob`][h2o_compress.jobs.AskJob] (every setting, before anything is
            loaded), [`AskJob.start`][h2o_compress.jobs.AskJob.start] and
            [`AskSession.answer`][h2o_compress.jobs.AskSession.answer]; a ConfigError for an unknown setting or an
            ``on_text``/``on_progress`` that is not callable.
    """
    job = AskJob.from_call(("questions", "context", "context_file", "model", "config"),
                           (questions, context, context_file, model, config), settings,
                           on_text=on_text, on_progress=on_progress)
    session = job.start(on_progress)
    results = [session._generate(question, on_text) for question in session.job.questions]
    answers = [_answer_figures(result, question) for result, question in zip(results, session.job.questions)]
    return AskReport(session.figures, answers, results)

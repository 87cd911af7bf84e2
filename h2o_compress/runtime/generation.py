"""`make_cache` and `generate`: the Python API of the compression pipeline (eviction then quantization)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Generator, Iterator

import torch

from h2o_compress.attention import use_h2o_attention
from h2o_compress.cache import CompressedCache, build_layers
from h2o_compress.cache.chunk import fill
from h2o_compress.persistence import PromptState
from h2o_compress.cache.own_caches import cache_class
from h2o_compress.runtime.decode_loop import TextStream, decoding, eos_ids, sampler, sync
from h2o_compress.runtime.chat import apply_chat_template, check_text_fits
from h2o_compress.config import CompressionConfig
from h2o_compress.attention.choice import check_kernel
from h2o_compress.attention.interface import check_attention_backend
from h2o_compress.formats import check_group_size, make_quantizer
from h2o_compress.runtime.compiled import (check_compile, compiled_decode_step, decode_step, resolve_compile,
                                           warmup_steps)
from h2o_compress.utils.checks import check_callback, check_count, check_flag, is_integer, is_real
from h2o_compress.utils.errors import CacheStateError, ConfigError, InputError, short
from h2o_compress.models import model_dims, torch_decode_reason
from h2o_compress.models.identity import model_identity, record_model
from h2o_compress.runtime.context_scores import (global_layer_capacities, hand_context_scores, read_prompt,
                                                 score_context, without_header)
from h2o_compress.runtime.prefill import check_cache_model, check_context, context_window, extend_prompt
from h2o_compress.models.weights import input_device
from h2o_compress.persistence.calibration_file import calibration_for, use_key_offsets


def make_cache(model, config: CompressionConfig | None = None, max_length: int | None = None,
               layer_capacities: list[int] | None = None) -> CompressedCache:
    """Build a [`CompressedCache`][h2o_compress.cache.CompressedCache] for ``model`` and switch the model to the ``h2o_compress`` attention.

    Args:
        model: a transformers causal LM whose attention goes through ``AttentionInterface``.
        config: the compression setting (default: no compression).
        max_length: tokens the cache will see (prompt + new tokens); needed when ``config.budget`` is a
            fraction below 1 (capacity = ``ceil(budget x max_length)`` tokens per layer and KV head). A prefill
            that would take the cache beyond it raises InputError (decode steps are not checked).
        layer_capacities: with ``config.layer_budgets == "global"``, each layer's capacity (tokens per KV head,
            one int >= 1 per layer: what `make_scored_cache` computes from the scores); default: the
            config's own split.

    Raises:
        ConfigError: ``model`` not a loaded model, bad ``max_length`` (beyond the model's context window too) or
            ``layer_capacities``, a fractional budget without ``max_length``, a group size that does not divide the
            model's ``head_dim``, or ``attention_kernel='triton'`` where the Triton op cannot run (`check_kernel`).
        UnsupportedModelError: the model's attention cannot be scored.
    """
    config = CacheRequest(model, config, max_length).config
    dims = model_dims(model.config)
    capacity = config.kept_tokens(max_length)
    if layer_capacities is not None:
        layer_capacities = _check_layer_capacities(layer_capacities, config, dims.num_layers, capacity)
    calibration = calibration_for(config, model)
    layers = build_layers(config, dims.num_layers, dims.head_dim, capacity, max_tokens=max_length,
                          capacities=layer_capacities, spans=dims.spans, torch_decode=torch_decode_reason(model, dims),
                          calibration=calibration, value_dim=dims.value_head_dim)
    use_key_offsets(layers, config, model, calibration)  # key_offsets="calibrated": keys around the calibrated mean
    use_h2o_attention(model)
    cache = cache_class(model.config)(layers, config, model_id=model_identity(model), capacity=capacity)
    cache.max_length = max_length  # a prefill beyond it is refused (the capacity was taken of it)
    record_model(cache, model)  # lets save_cache() check the model (the file's fingerprint, the filling modules)
    return cache


@dataclass(frozen=True)
class CacheRequest:
    """The cache [`make_cache`][h2o_compress.runtime.generation.make_cache] is asked for, validated once, when made:
    the setting against where it runs (what a setting allows on its own is
    [`CompressionConfig`][h2o_compress.config.CompressionConfig]'s check, run when it is built).

    Attributes:
        model: a loaded transformers causal LM: its attention must go through ``AttentionInterface`` and be one a
            compressed cache can follow, and ``group_size`` must divide its ``head_dim`` (when quantized).
        config: the setting (``None``: no compression); once made, the one the cache is built with (``rotate``
            off for a model whose attention expands the cached latents itself: no basis to undo).
        max_length: tokens the cache will see, 1 to the model's context window (`MAX_LENGTH` when it declares
            none), or ``None``.

    Raises (when made):
        ConfigError: ``model`` not a loaded model, a bad ``max_length`` or ``config``, a group size that does not
            divide the model's ``head_dim``, or ``attention_kernel='triton'`` where the Triton op cannot run on the
            model's input device (`check_kernel`).
        UnsupportedModelError: the model's attention cannot be followed.
    """

    model: object
    config: CompressionConfig | None = None
    max_length: int | None = None

    def __post_init__(self) -> None:
        model = self.model
        check_model(model, config=False)
        check_max_length(self.max_length, context_window(model))
        config = check_config(self.config)
        check_attention_backend(model)
        dims = model_dims(model.config)
        head_dim = dims.head_dim
        if config.quantized:
            check_group_size(config.group_size, head_dim)
        formats = tuple(make_quantizer(bits, config.quant, config.group_size, head_dim, config.rotate)
                        for bits in (config.key_bits, config.value_bits))
        check_kernel(config.attention_kernel, input_device(model), head_dim, formats)
        if dims.expands_cache and config.rotate:
            config = dataclasses.replace(config, rotate=False)
        object.__setattr__(self, "config", config)


def _check_layer_capacities(capacities, config: CompressionConfig, num_layers: int, capacity: int | None) -> list[int]:
    """``capacities`` as a list of ``num_layers`` ints >= 1, given for ``layer_budgets="global"`` and a bounded
    cache; raises ConfigError naming what is wrong."""
    if config.layer_budgets != "global" or capacity is None:
        raise ConfigError(f"layer_capacities given with layer_budgets={config.layer_budgets!r} and capacity "
                          f"{capacity}; allowed: layer_capacities only with layer_budgets 'global' and a budget below 1")
    values = list(capacities) if isinstance(capacities, (list, tuple)) else None
    if values is None or len(values) != num_layers or any(not is_integer(c) or c < 1 for c in values):
        raise ConfigError(f"layer_capacities={short(capacities)} is invalid; allowed: {num_layers} integers >= 1 "
                          "(tokens per KV head, one per layer)")
    return values


def make_scored_cache(model, tokenizer, input_ids: torch.Tensor, config: CompressionConfig, max_length: int,
                      question_in_prompt: bool = False) -> CompressedCache:
    """A cache ready for the prefill of ``input_ids`` ``[batch, tokens]``: for ``snapkv``, ``kvzip`` and
    ``lookahead`` their scoring pass runs first (`score_context`), the cache is built with the layer
    capacities those scores give under ``layer_budgets="global"``
    (`global_layer_capacities`; the config's own split otherwise), and each
    layer gets its scores for the prefill. ``snapkv``'s pass reads the prompt whole (`read_prompt`), and where
    the cache can take them (`lay_prompt`) its keys and values are laid into the cache directly, ranked and
    evicted once, with the prompt's next-token logits recorded (the prefill then runs no forward pass); a prompt
    no longer than the capacity is not scored (nothing of it is evicted). Other policies: ``make_cache(model,
    config, max_length)``.
    ``question_in_prompt``: ``input_ids`` is a whole prompt, question included (``generate``), not a document
    asked about later.

    Raises:
        ConfigError: a bad setting (see [`make_cache`][h2o_compress.runtime.generation.make_cache]).
        ValueError: from transformers, for a model without an ``eager`` attention implementation (the passes).
    """
    config = check_config(config)
    policy, capacity = config.eviction_policy(), config.kept_tokens(max_length)  # the cache's capacity
    reading = _prompt_reading(policy, question_in_prompt)
    if not policy.scorer or (reading and (capacity is None or capacity >= input_ids.shape[1]
                                          or not reads_whole(model))):
        return make_cache(model, config, max_length)
    read = None
    if reading:
        read = read_prompt(model, input_ids, chunk=config.prefill_chunk_size or input_ids.shape[1], **reading)
        scores = without_header(tokenizer, input_ids, read.scores, policy)
    else:
        scores = score_context(model, tokenizer, input_ids, policy, question_in_prompt)
    capacities = None
    if config.layer_budgets == "global" and capacity is not None:
        capacities = global_layer_capacities(scores, capacity, config.min_layer_capacity(capacity), max_length,
                                             config.sinks)
    cache = make_cache(model, config, max_length, layer_capacities=capacities)
    if read is None or not lay_prompt(model, cache, read, input_ids, scores):
        hand_context_scores(model, tokenizer, input_ids, cache, scores=scores)
    return cache


def reads_whole(model) -> bool:
    """Whether a prompt can be read whole into transformers' ``DynamicCache`` and laid into the compressed cache
    (`read_prompt`, `lay_prompt`): attention layers only, held in a `CompressedCache` itself (not a hybrid's
    constant states, not a model's own cache class). Elsewhere ``snapkv`` and ``lookahead`` on a prompt that holds
    its question rank it as ``h2o``, chunk by chunk."""
    spans = model_dims(model.config).spans
    return cache_class(model.config) is CompressedCache and not any(s.stateful or s.paired for s in spans)


def _prompt_reading(policy, question_in_prompt: bool) -> dict | None:
    """`read_prompt`'s arguments where ``policy`` ranks a prompt by its own end: ``snapkv`` (its observation window)
    and, on a prompt that holds its question, ``lookahead`` (the prompt's last token and the model's answer); else
    ``None`` (another scoring pass, or none)."""
    if policy.scorer == "observation_window":
        return {"window": policy.window, "pool": policy.pool}
    if policy.scorer == "lookahead" and policy.request_for(question_in_prompt) is None:
        return {"window": 1, "pool": policy.pool, "answer_tokens": policy.new_tokens - 1}
    return None


def lay_prompt(model, cache: CompressedCache, read, input_ids: torch.Tensor, scores: list[torch.Tensor]) -> bool:
    """Lay the prompt ``read`` holds (`read_prompt`: every token's keys and values, uncompressed) into the empty
    ``cache``, each layer ranked by its ``scores`` and evicted to its capacity once (`h2o_compress.cache.chunk.fill`),
    and record the prompt ``input_ids`` ``[batch, tokens]`` and its next-token logits, so that `prefill` runs no
    forward pass. Only where the read cache's layers are the cache's one for one, with the same shapes (not
    values of another width): returns ``False`` and lays
    nothing otherwise (the caller hands the scores to a prefill instead). The model was checked first
    (`reads_whole`): attention layers only, in a `CompressedCache` itself."""
    held, layers = read.cache.layers, cache.layers
    if len(held) != len(layers):
        return False
    for source, layer in zip(held, layers):
        keys, values = getattr(source, "keys", None), getattr(source, "values", None)
        if keys is None or values is None or keys.shape[2] != input_ids.shape[1] or (
                values.shape[-1] != (layer.setting.value_dim or keys.shape[-1])):
            return False
    q_heads = model_dims(model.config).num_heads
    for source, layer, layer_scores in zip(held, layers, scores):
        fill(layer, source.keys, source.values, layer_scores, q_heads)
    cache.prompt_state = PromptState(input_ids.detach().to("cpu", copy=True), read.logits.detach().clone())
    return True


MAX_LENGTH = 2**31 - 1
"""The most tokens a cache may be made for when the model declares no context window."""


def check_max_length(max_length, window: int | None) -> None:
    """Refuse a ``max_length`` (tokens a cache will see) that is not an integer from 1 to the model's context
    ``window`` (`MAX_LENGTH` when it declares none): no prompt plus new tokens can go beyond it.

    Raises:
        ConfigError: naming the value and the range allowed.
    """
    most = window or MAX_LENGTH
    if max_length is not None:
        where = "the model's context window" if window else "tokens"
        check_count("max_length", max_length, maximum=most,
                    allowed=f"an integer >= 1 (tokens), at most {most} ({where})")


#: What ``on_text`` (the streaming callback of `generate` and the jobs) may be.
ON_TEXT = "a function taking each new piece of text, or None"


def check_model(model, config: bool = True) -> None:
    """Refuse a ``model`` that is not a loaded transformers model (a name, ``None``) with one clear ConfigError,
    not an AttributeError from deep inside; ``config``: a torch module without a transformers ``config`` is refused
    too (``False``: it is left to `CacheRequest`, which names what its attention lacks)."""
    if not isinstance(model, torch.nn.Module) or (config and not hasattr(model, "config")):
        raise ConfigError(f"model={short(model)} is not a loaded transformers model; allowed: the model of "
                          "h2o_compress.load_model(...) (or any transformers causal LM)")


def _check_argument_kinds(model, tokenizer, on_text) -> None:
    """Refuse arguments of the wrong kind with one clear ConfigError (not an AttributeError from deep inside)."""
    check_model(model)
    if not (callable(getattr(tokenizer, "decode", None)) and (callable(getattr(tokenizer, "encode", None))
                                                              or callable(tokenizer))):
        raise ConfigError(f"tokenizer={short(tokenizer)} is not a tokenizer; allowed: the tokenizer of "
                          "h2o_compress.load_model(...) (or any transformers tokenizer)")
    check_callback("on_text", on_text, ON_TEXT)


def check_config(config) -> CompressionConfig:
    """``config``, or the no-compression default for ``None``.

    Raises:
        ConfigError: ``config`` is neither a [`CompressionConfig`][h2o_compress.config.CompressionConfig] nor ``None``.
    """
    if config is None:
        return CompressionConfig()
    if not isinstance(config, CompressionConfig):
        raise ConfigError(f"config={short(config)} is invalid; allowed: a CompressionConfig or None")
    return config


@dataclass
class GenerationResult:
    """Output and figures of one [`generate`][h2o_compress.runtime.generation.generate] call.

    Attributes:
        text: the generated text (prompt excluded).
        prompt_tokens: tokens of the prompt.
        new_tokens: tokens generated.
        kv_bytes: ``cache.nbytes()`` at the end (bytes).
        kv_bytes_full_fp16: bytes of the uncompressed fp16 cache for the same tokens.
        capacity: tokens kept per layer and KV head (``None``: unbounded).
        prefill_s: seconds of the prompt forward pass (gives the first new token), with the scoring pass of
            ``kvzip`` and ``lookahead`` before it.
        decode_s: seconds of the decode forward passes (with ``compiled``, the first ones, which compile and on
            CUDA record the CUDA graph (`h2o_compress.runtime.compiled.warmup_steps`), are left out and reported as
            ``compile_s``).
        decode_tokens_per_s: decode forward passes per second (of those counted in ``decode_s``).
        compiled: whether the decode steps ran compiled (`h2o_compress.runtime.compiled`).
        compile_s: seconds of the compiled step's warm-up calls (compilation included); 0 when not compiled.
        decode_kernel: the decode attention the layers ran ([`CompressedCache.decode_kernel`][h2o_compress.cache.CompressedCache.decode_kernel]): ``cpu``,
            ``triton`` or ``torch``, joined by ``+`` where layers differ; empty when nothing was decoded.
        kv_bytes_held: bytes of the keys and values held at the end, in the slots holding a token
            ([`CompressedCache.held_nbytes`][h2o_compress.cache.CompressedCache.held_nbytes]): the like-with-like
            counterpart of ``kv_bytes_full``. ``kv_bytes - kv_bytes_held - kv_state_bytes`` is bookkeeping
            (positions, scores, counters) and free slots.
        kv_bytes_full: bytes of the uncompressed cache in the model's own dtype (float32 on a CPU) for the same
            tokens ([`CompressedCache.full_nbytes`][h2o_compress.cache.CompressedCache.full_nbytes]): the cache the
            model would have had; attention layers only.
        kv_state_bytes: bytes of a hybrid model's constant linear-attention/SSM/convolution states (in
            ``kv_bytes``, uncompressed, the same without compression); 0 for other models.
    """

    text: str
    prompt_tokens: int
    new_tokens: int
    kv_bytes: int
    kv_bytes_full_fp16: int
    capacity: int | None
    prefill_s: float
    decode_s: float
    decode_tokens_per_s: float
    compiled: bool = False
    compile_s: float = 0.0
    decode_kernel: str = ""
    token_ids: list[int] = field(default_factory=list, repr=False)
    kv_bytes_held: int = 0
    kv_bytes_full: int = 0
    kv_state_bytes: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


MAX_NEW_TOKENS = 2**31 - 1
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 1e3  # below/above these, softmax(logits / t) over- or underflows


def check_generation_args(max_new_tokens, temperature, seed) -> None:
    """Validate the arguments of [`generate`][h2o_compress.runtime.generation.generate] (also run by the CLI before any side effect).

    Raises:
        ConfigError: ``max_new_tokens`` not an integer >= 1, ``temperature`` neither 0 nor in
            [`MIN_TEMPERATURE`, `MAX_TEMPERATURE`], or ``seed`` not an integer in [0, 2**64).
    """
    if seed is not None:
        check_count("seed", seed, minimum=0, maximum=2**64 - 1, allowed="an integer in [0, 2**64) or None")
    check_count("max_new_tokens", max_new_tokens, unit="", maximum=MAX_NEW_TOKENS)
    if not is_real(temperature) or not (temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE):
        raise ConfigError(
            f"temperature={short(temperature)} is invalid; allowed: a number >= 0 (0 = greedy, else from "
            f"{MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g})"
        )


def check_prompt(prompt) -> str:
    """``prompt`` if it is a non-empty text that can be encoded as UTF-8.

    Raises:
        InputError: not a string, empty or whitespace only, or holding lone surrogates (invalid UTF-8 bytes
            on the command line arrive as those).
    """
    if not isinstance(prompt, str):
        raise InputError(f"prompt {short(prompt)} is a {type(prompt).__name__}, not a text; allowed: a non-empty str "
                         "(arguments in the order model, tokenizer, prompt)")
    if not prompt.strip():
        raise InputError(f"prompt {short(prompt)} is empty; allowed: a non-empty text")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(
            f"prompt holds a character that is not valid UTF-8 at position {exc.start}; allowed: UTF-8 text"
        ) from None
    return prompt


def encode_prompt(tokenizer, prompt: str, chat: bool = True, window: int | None = None) -> torch.Tensor:
    """Token ids ``[1, tokens]`` of ``prompt``, through the tokenizer's chat template when ``chat``.

    Args:
        tokenizer: the model's tokenizer.
        prompt: the text.
        chat: apply the tokenizer's chat template (when it has one).
        window: the model's context window (tokens; `context_window`): a prompt too long to fit it whatever the
            tokenization is refused from its length, before the tokenizer spends minutes and gigabytes on it
            (`check_text_fits`). ``None``: no such check.

    Raises:
        InputError: empty or whitespace-only prompt, one that is not valid UTF-8, or one longer than ``window``
            could hold.
    """
    check_prompt(prompt)
    check_text_fits(tokenizer, prompt, window, "the prompt")
    if chat and getattr(tokenizer, "chat_template", None):
        encoded = apply_chat_template(
            tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=True,
            return_tensors="pt",
        )
        return encoded["input_ids"]
    return tokenizer(prompt, return_tensors="pt").input_ids


@torch.inference_mode()
def generate(
    model,
    tokenizer,
    prompt: str,
    config: CompressionConfig | None = None,
    max_new_tokens: int = 128,
    chat: bool = True,
    temperature: float = 0.0,
    seed: int | None = None,
    on_text: Callable[[str], None] | None = None,
    cache: CompressedCache | None = None,
    compile: bool | None = None,
) -> GenerationResult:
    """Generate from ``prompt`` with a compressed KV cache (greedy by default).

    The budget fraction applies to ``prompt tokens + max_new_tokens``. ``on_text`` receives each new piece of
    text as it is generated (streaming). Stops at the tokenizer's end-of-sequence token. ``cache`` continues
    from an existing cache (e.g. [`h2o_compress.load_cache`][h2o_compress.load_cache]): only the prompt tokens it does not hold yet
    are fed (see `h2o_compress.runtime.prefill.prefill`). ``compile`` runs the decode steps through
    `h2o_compress.runtime.compiled.compiled_decode_step` (``None``: on with CUDA, off on CPU, where eager measured
    faster); the prefill stays eager. The NaN/Inf flags of the decode steps are read once, at the end.

    Raises:
        InputError: empty prompt, prompt + new tokens longer than the model's context or than the
            ``max_length`` ``cache`` was made for (checked once, before the prefill), or a prompt that does not
            extend the one ``cache`` holds.
        ConfigError: bad ``max_new_tokens``/``temperature``/``seed`` or compression setting.
        CacheStateError: ``cache`` and ``config`` both given and different, ``cache`` not a CompressedCache, or
            ``cache`` filled by another model (its ``model_fingerprint``; checked once per generation).
        InputError: NaN or Inf reached the cache during decoding (read once, at the end).
        ConfigError: ``model`` is not a loaded model (e.g. a name: use [`load_model`][h2o_compress.load_model]),
            ``tokenizer`` has no ``encode``/``decode``, ``on_text`` is not callable, or ``chat`` is not a bool.
    """
    request = _checked_generation(model, tokenizer, config, cache, max_new_tokens, temperature, seed, on_text, chat,
                                  compile)
    return run_generation(model, tokenizer, prompt, request, on_text, cache)


class GenerationStream:
    """The text pieces of one generation, as they are decoded (what [`stream`][h2o_compress.stream] returns): an
    iterator of ``str`` that runs the decode loop one step per piece it is asked for, in the caller's thread; the
    pieces join to the generation's text. ``result`` is the
    [`GenerationResult`][h2o_compress.runtime.generation.GenerationResult] once the iterator is exhausted (``None``
    before). Stopping early (``break``) leaves the generation unfinished: no result, the cache as far as it got.
    """

    def __init__(self, run: Generator[str, None, GenerationResult]):
        self._run = run
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        if self.result is not None:
            raise StopIteration
        try:
            return next(self._run)
        except StopIteration as stop:
            self.result = stop.value
            raise StopIteration from None


def stream(
    model,
    tokenizer,
    prompt: str,
    config: CompressionConfig | None = None,
    max_new_tokens: int = 128,
    chat: bool = True,
    temperature: float = 0.0,
    seed: int | None = None,
    cache: CompressedCache | None = None,
    compile: bool | None = None,
) -> GenerationStream:
    """[`generate`][h2o_compress.generate] as an iterator of the new text's pieces, yielded as they are decoded
    (the same decode loop as ``generate``'s ``on_text``, driven by the iteration: no thread).

    ``for piece in stream(model, tokenizer, prompt, config): print(piece, end="")``; the pieces join to what
    ``generate`` returns as ``text`` for the same arguments, and the stream's ``result`` is then its
    [`GenerationResult`][h2o_compress.runtime.generation.GenerationResult]. The arguments are as ``generate``'s.

    Raises:
        ConfigError, CacheStateError: a bad argument, raised here, before anything runs.
        InputError, CacheStateError: what needs the prompt's tokens or the cache (as ``generate`` says), raised by
            the first ``next()``.
    """
    request = _checked_generation(model, tokenizer, config, cache, max_new_tokens, temperature, seed, None, chat,
                                  compile)
    return GenerationStream(_generation(model, tokenizer, prompt, request, True, cache))


@dataclass(frozen=True)
class GenerationRequest:
    """The settings of one generation, validated once, when made: what [`generate`][h2o_compress.generate] builds
    of its arguments, and what a job ([`GenerateJob`][h2o_compress.jobs.GenerateJob], ``AskJob``) builds when it is
    made, so a command is checked where it enters and the runtime (`run_generation`) trusts it.

    Attributes:
        config: the compression setting (``None``: the no-compression default); with a cache, the cache's.
        max_new_tokens: tokens to generate at most, 1 to `MAX_NEW_TOKENS`.
        chat: apply the tokenizer's chat template (a bool).
        temperature: 0 (greedy), or from `MIN_TEMPERATURE` to `MAX_TEMPERATURE`.
        seed: the sampling seed, an integer in [0, 2**64), or ``None``.
        compile: compile the decode steps (``None``: auto); ``True`` only for a setting that can compile.

    Raises (when made):
        ConfigError: naming the first value that is invalid and what is allowed (``config``, then
            ``max_new_tokens``/``temperature``/``seed`` as `check_generation_args` says, ``chat``, ``compile``).
    """

    config: CompressionConfig | None = None
    max_new_tokens: int = 128
    chat: bool = True
    temperature: float = 0.0
    seed: int | None = None
    compile: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "config", check_config(self.config))
        check_generation_args(self.max_new_tokens, self.temperature, self.seed)
        check_flag("chat", self.chat)
        check_compile(self.compile, self.config)


@torch.inference_mode()
def run_generation(model, tokenizer, prompt: str, request: GenerationRequest,
                   on_text: Callable[[str], None] | None = None,
                   cache: CompressedCache | None = None) -> GenerationResult:
    """Run one validated ``request`` (its settings are trusted): [`generate`][h2o_compress.runtime.generation.generate]
    past its argument checks, for ``model``, ``tokenizer`` and ``on_text`` of the right kind and ``cache`` ``None``
    or a CompressedCache of ``request.config``. What needs the prompt's tokens or the cache (the prompt, the
    window, the cache's room and model, whether the cache can compile) is checked here, as ``generate`` checks it.

    Raises:
        InputError, CacheStateError, ConfigError: as `generate` says, but for what the request validated.
    """
    run = _generation(model, tokenizer, prompt, request, on_text is not None, cache)
    while True:
        try:
            piece = next(run)
        except StopIteration as stop:
            return stop.value
        on_text(piece)


@torch.inference_mode()
def _generation(model, tokenizer, prompt: str, request: GenerationRequest, pieces: bool,
                cache: CompressedCache | None) -> Generator[str, None, GenerationResult]:
    """The one generation of `run_generation` and `stream` (the arguments as there): yields each new piece of
    text as it is decoded where ``pieces`` (a `TextStream` over the decode loop's ids: they join to the result's
    ``text``), nothing otherwise, and returns the [`GenerationResult`][h2o_compress.runtime.generation.GenerationResult].

    Raises:
        InputError, CacheStateError, ConfigError: as `run_generation` says.
    """
    max_new_tokens, chat = request.max_new_tokens, request.chat
    device = input_device(model)
    input_ids = encode_prompt(tokenizer, prompt, chat, context_window(model)).to(device)
    prompt_tokens = input_ids.shape[1]
    check_context(model, prompt_tokens, max_new_tokens)
    cache, scoring_s = _scored_cache(model, tokenizer, input_ids, request.config, cache, max_new_tokens)
    compiled = resolve_compile(request.compile, cache, device, model)
    step = compiled_decode_step(model, device) if compiled else decode_step
    pick = sampler(request.temperature, request.seed, device)
    sync(device)
    start = time.perf_counter()
    token = pick(extend_prompt(model, input_ids, cache))  # checked above
    sync(device)
    prefill_s = time.perf_counter() - start + scoring_s
    found: list[str] = []
    text = TextStream(tokenizer, found.append) if pieces else None
    untimed = warmup_steps(device) if compiled else 0  # decode steps that compile / record: not a decode speed
    loop = decoding(step, model, cache, token, prompt_tokens, pick, eos_ids(model, tokenizer), max_new_tokens, untimed)
    while True:
        try:
            ids = next(loop)
        except StopIteration as stop:
            generated, decode_s, compile_s = stop.value
            break
        if text is not None:
            text.update(ids)
            yield from found
            found.clear()
    steps = max(len(generated) - 1 - untimed, 0)
    cache.check()
    return _result(tokenizer, cache, generated, prompt_tokens, prefill_s, decode_s, steps, compiled, compile_s)


def _scored_cache(model, tokenizer, input_ids: torch.Tensor, config: CompressionConfig,
                  cache: CompressedCache | None, max_new_tokens: int) -> tuple[CompressedCache, float]:
    """The cache `generate` fills: ``cache`` (checked once, before any forward pass: room for the prompt and the
    new tokens, the same model) or a new one for ``config``; a policy that scores the prompt before the cache is
    built (kvzip, lookahead) runs its pass here.

    Args:
        input_ids: the prompt, ``[1, prompt_tokens]`` on the model's input device.
        cache: a cache to continue, or ``None``.
        max_new_tokens: the new tokens the cache must have room for.

    Returns:
        ``(cache, seconds)``: the seconds of the scoring pass (0 without one), counted in the prefill's time.

    Raises:
        InputError: ``cache`` has no room for the prompt and the new tokens (``prompt_tokens + max_new_tokens``
            beyond the ``max_length`` it was made for; decode steps are not checked, so this is the check).
        CacheStateError: ``cache`` was filled by another model.
    """
    prompt_tokens = input_ids.shape[1]
    if cache is not None:  # once per generation, before any forward pass: no check in the decode steps
        limit = getattr(cache, "max_length", None)  # what make_cache was told it will see
        if limit is not None and prompt_tokens + max_new_tokens > limit:
            raise InputError(
                f"prompt of {prompt_tokens} tokens + max_new_tokens={max_new_tokens} exceeds the cache's max_length "
                f"of {limit} tokens (what make_cache was told it will see); allowed: max_new_tokens at most "
                f"{max(limit - prompt_tokens, 0)}, or a cache made with max_length >= {prompt_tokens + max_new_tokens}"
            )
        check_cache_model(cache, model)
    device = input_ids.device
    sync(device)
    start = time.perf_counter()
    if cache is None:
        cache = make_scored_cache(model, tokenizer, input_ids, config, prompt_tokens + max_new_tokens,
                                  question_in_prompt=True)
    elif cache.seen_tokens() == 0:  # a fresh cache given: kvzip and lookahead score the prompt first
        hand_context_scores(model, tokenizer, input_ids, cache, question_in_prompt=True)
    sync(device)
    return cache, time.perf_counter() - start


def _checked_generation(model, tokenizer, config, cache, max_new_tokens, temperature, seed, on_text, chat,
                        compile) -> GenerationRequest:
    """`generate`'s arguments checked before anything runs; returns its request, for the setting it runs with
    (``config``, or the given cache's).

    Raises:
        ConfigError, CacheStateError: as `generate` says.
    """
    _check_argument_kinds(model, tokenizer, on_text)
    if cache is not None and not isinstance(cache, CompressedCache):
        raise CacheStateError(f"cache={short(cache)} is not a CompressedCache; allowed: a cache of "
                              "h2o_compress.make_cache(...) or load_cache(...), or None")
    if cache is None:
        config = check_config(config)
    elif config is None:
        config = cache.config
    elif check_config(config) != cache.config:
        raise CacheStateError(f"config {config} differs from the cache's {cache.config}; pass one of them")
    return GenerationRequest(config, max_new_tokens, chat, temperature, seed, compile)


def _result(tokenizer, cache, generated: list[int], prompt_tokens: int, prefill_s: float, decode_s: float,
            steps: int, compiled: bool, compile_s: float) -> GenerationResult:
    """The [`GenerationResult`][h2o_compress.runtime.generation.GenerationResult] of a finished `generate`
    (``steps``: the timed decode steps)."""
    return GenerationResult(
        text=tokenizer.decode(generated, skip_special_tokens=True),
        prompt_tokens=prompt_tokens,
        new_tokens=len(generated),
        kv_bytes=cache.nbytes(),
        kv_bytes_full_fp16=cache.full_fp16_nbytes(),
        capacity=cache.capacity,
        prefill_s=prefill_s,
        decode_s=decode_s,
        decode_tokens_per_s=steps / decode_s if decode_s > 0 else 0.0,
        compiled=compiled,
        compile_s=compile_s,
        decode_kernel=cache.decode_kernel,
        token_ids=generated,
        kv_bytes_held=cache.held_nbytes(),
        kv_bytes_full=cache.full_nbytes(),
        kv_state_bytes=cache.state_nbytes(),
    )

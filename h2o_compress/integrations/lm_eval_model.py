"""The lm-evaluation-harness model type ``h2o-compress``: lm-eval's ``HFLM`` evaluated through our compressed cache.

Import this module (or run ``h2o-compress eval lm-eval``) and lm-eval knows the model type:

```python
import lm_eval
import h2o_compress.integrations.lm_eval_model  # registers "h2o-compress"
results = lm_eval.simple_evaluate(model="h2o-compress", model_args="pretrained=smollm2-135m,budget=0.2,kv_bits=4",
                                  tasks=["lambada_openai"])
```

lm-eval 0.4.13 (the newest release installable here) finds models only in its registry, so the import is what
registers the type; ``pyproject.toml`` also declares it as an entry point in the ``lm_eval.models`` group for the
versions that load plugins. Needs the ``lm-eval`` extra (``pip install -e .[lm-eval]``).

Why not plain ``HFLM`` with a compressed cache: lm-eval scores a loglikelihood request in one forward pass over
context + continuation, so a cache that evicts after that pass changes nothing it measures (lm-eval issues #1105,
#3298). Here each request type goes through the compressed cache where it matters:

- **loglikelihood** (multiple choice, lambada...): the context is prefilled through a fresh compressed cache whose
  budget fraction is relative to the context's tokens, so the cache is compressed down to its capacity at the end of
  the prefill; the continuation is then scored against that compressed cache as **one chunk appended after it, on a
  frozen copy** ([`frozen_copy`][h2o_compress.cache.CompressedCache.frozen_copy]: nothing more is evicted; the tokens
  after the context are kept as they come). Why one chunk and not decode steps: it is the compress-then-ask protocol
  of [`h2o_compress.runtime.ask`][h2o_compress.runtime.ask.ask] (kvpress): every choice of a question is scored against the *same* compressed context,
  prefilled and compressed once per context (not once per choice, and not with a capacity that depends on the
  choice's length); a continuation is an answer of a few tokens, so what decode steps could evict during it is at
  most its own length; and it costs one forward pass per continuation. The first continuation token is scored from
  the prefill's last logits, the others from the chunk's.
- **generate_until**: ``model.generate`` decodes with a [`CompressedCache`][h2o_compress.cache.CompressedCache] built for
  context + ``max_gen_toks`` (the budget fraction is relative to that, as in [`h2o_compress.generate`][h2o_compress.generate]), so
  eviction and quantization act at the prefill and at every decode step.
- **loglikelihood_rolling** (perplexity tasks such as wikitext): each of lm-eval's disjoint windows (at most
  ``max_length`` tokens) streams through its own compressed cache ``chunk_size`` tokens per forward pass (default 1:
  exact decode semantics, every token attends only to the kept, possibly quantized, cache; the budget fraction is
  relative to the window), as ``h2o-compress eval perplexity`` does (`h2o_compress.evaluation.stream.read_stream`).

At ``budget=1.0`` and 16 bits nothing is evicted or quantized, and the scores are lm-eval's ``hf`` model's (the
log-likelihoods equal to float reassociation: the context and continuation are computed in two passes).

Batch size 1 only: requests are scored one at a time (a context shared by several continuations is prefilled once).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from h2o_compress.config import (
    COMMAND_POLICY, LEGACY_OPTIONS, MAX_TOKENS, SETTING_DEFAULTS, CompressionConfig, check_usable, parse_budget,
)
from h2o_compress.utils.errors import ConfigError, short
from h2o_compress.runtime.generation import check_max_length, make_cache, make_scored_cache
from h2o_compress.runtime.prefill import context_window, extend_prompt
from h2o_compress.models import DEFAULT_MODEL, load_model, placement_options
from h2o_compress.models.loading import check_model_name
from h2o_compress.persistence.calibration_file import read_calibration
from h2o_compress.models.weights import check_weight_options
from h2o_compress.evaluation.stream import read_stream
from h2o_compress.utils.checks import check_count, is_real

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
    from lm_eval import utils as lm_eval_utils
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ConfigError(
        "lm-evaluation-harness is not installed; allowed: pip install -e '.[lm-eval]' (lm_eval>=0.4.13)"
    ) from exc

MODEL_TYPE = "h2o-compress"
# the config's fields, and the policy options earlier versions had as fields (profile rows still write them)
COMPRESSION_ARGS = tuple(SETTING_DEFAULTS) + tuple(LEGACY_OPTIONS)
"""model_args that set the compression (the fields of [`CompressionConfig`][h2o_compress.config.CompressionConfig])."""
OWN_ARGS = ("pretrained", "tokenizer", "device", "dtype", "weights_bits", "trust_remote_code", "batch_size",
            "chunk_size")
"""model_args this model type reads itself."""
HFLM_ARGS = (
    "max_length", "truncation", "add_bos_token", "prefix_token_id", "softmax_dtype", "think_end_token",
    "enable_thinking", "chat_template_args", "max_batch_size", "logits_cache", "backend", "use_fast_tokenizer",
)
"""HFLM arguments that still apply to a model loaded by us (the others only concern HFLM's own loading)."""


def compression_from_args(args: dict) -> CompressionConfig:
    """The [`CompressionConfig`][h2o_compress.config.CompressionConfig] of the compression keys of ``args`` (lm-eval model_args, values already cast
    by lm-eval: ``budget=0.2`` is a float, ``kv_bits=4`` an int, ``rotate=false`` a bool), checked as the CLI checks
    its flags ([`check_usable`][h2o_compress.config.check_usable]).

    ``budget`` reads as ``--budget`` does: ``1`` (or ``1.0``) keeps everything, a fraction in (0, 1) is relative to
    the sequence, an integer > 1 is a number of tokens.

    Raises:
        ConfigError: a bad value, naming it and what is allowed.
    """

    values = {"policy": COMMAND_POLICY} | {name: args[name] for name in COMPRESSION_ARGS if name in args}
    if "budget" in values:
        budget = values["budget"]
        if not (is_real(budget) or isinstance(budget, str)):
            raise ConfigError(f"budget={short(budget)} is invalid; allowed: a fraction in (0, 1] or an integer >= 1")
        values["budget"] = parse_budget(str(budget))
    return check_usable(CompressionConfig(**values))


def check_model_args(args: dict) -> CompressionConfig:
    """Validate lm-eval ``model_args`` of the ``h2o-compress`` type before anything is loaded.

    Returns:
        The compression setting.

    Raises:
        ConfigError: an unknown key, a bad compression value, a batch size other than 1, a bad ``chunk_size``,
            ``weights_bits``, ``device``, ``dtype`` or ``trust_remote_code``, or a ``tokenizer`` given with a
            ``pretrained`` name (it is loaded with the model).
        ModelLoadError: an empty ``pretrained``.
        CacheFileError: a ``calibration`` file that is missing or not one `h2o-compress calibrate` wrote.
    """
    unknown = sorted(set(args) - set(COMPRESSION_ARGS) - set(OWN_ARGS) - set(HFLM_ARGS))
    if unknown:
        raise ConfigError(
            f"unknown model_args {', '.join(map(short, unknown))} for model type {MODEL_TYPE!r}; allowed: "
            f"{', '.join(OWN_ARGS + COMPRESSION_ARGS + HFLM_ARGS)}"
        )
    config = compression_from_args(args)
    batch = args.get("batch_size", 1)
    if str(batch) != "1":
        raise ConfigError(
            f"batch_size={short(batch)} is not supported by model type {MODEL_TYPE!r}: requests are scored one at a "
            "time through the compressed cache; allowed: 1"
        )
    check_count("chunk_size", args.get("chunk_size", 1))
    check_weight_options(weights_bits=args.get("weights_bits"))
    _check_load_args(args)
    _check_hflm_args(args)
    if isinstance(args.get("pretrained", DEFAULT_MODEL), str) and args.get("tokenizer") is not None:
        raise ConfigError(
            "tokenizer= is only for an already-loaded model passed as pretrained=; with a model name or directory "
            "the tokenizer is loaded with it; allowed: no tokenizer"
        )
    if args.get("backend", "causal") not in ("causal", "default"):
        raise ConfigError(f"backend={short(args['backend'])} is not supported; allowed: causal (decoder-only models)")
    return config


SOFTMAX_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _check_load_args(args: dict) -> None:
    """What loading checks first, checked before lm-eval reads its tasks: for a model named by ``pretrained`` (an
    already-loaded one ignores the loading arguments), the name (not empty: `check_model_name`), ``trust_remote_code``
    (a bool), and ``device``, ``dtype`` (``auto``: the default) and ``weights_bits`` together (`placement_options`);
    a ``calibration`` file as ``--calibration`` reads it (`read_calibration`: missing, not a calibration file, or
    modified). The messages are those of the CLI's ``--model``, ``--device``, ``--dtype`` and ``--calibration``.

    Raises:
        ModelLoadError: an empty ``pretrained``; 8/4-bit weights bitsandbytes cannot run here.
        ConfigError: a ``trust_remote_code`` that is not a bool, a bad ``device`` or ``dtype``.
        CacheFileError: a ``calibration`` file that cannot be used.
    """
    pretrained = args.get("pretrained", DEFAULT_MODEL)
    if isinstance(pretrained, str):
        check_model_name(pretrained, args.get("trust_remote_code", False))
        dtype = args.get("dtype")
        placement_options(device=args.get("device", "auto"), dtype=None if dtype == "auto" else dtype,
                          weights_bits=args.get("weights_bits"), name_or_path=pretrained)
    if args.get("calibration") is not None:
        read_calibration(args["calibration"])


def _check_hflm_args(args: dict) -> None:
    """``max_length`` (an integer from 1 to `MAX_TOKENS`; lm-eval reads a 5,000-digit
    one as ``inf``) and ``softmax_dtype`` (a float dtype name), as the CLI checks its own options. Raises ConfigError."""
    length = args.get("max_length")
    if length is not None:
        check_count("max_length", length, maximum=MAX_TOKENS,
                    allowed=f"an integer from 1 to {MAX_TOKENS} (tokens), or no max_length (the model's own)")
    dtype = args.get("softmax_dtype")
    if dtype is not None and not isinstance(dtype, torch.dtype) and dtype not in SOFTMAX_DTYPES:
        raise ConfigError(f"softmax_dtype={short(dtype)} is not supported; allowed: {', '.join(SOFTMAX_DTYPES)}, or "
                          "no softmax_dtype (the logits' own)")
    if isinstance(dtype, torch.dtype) and not dtype.is_floating_point:
        raise ConfigError(f"softmax_dtype={dtype} is not supported; allowed: {', '.join(SOFTMAX_DTYPES)}")


@register_model(MODEL_TYPE)
class H2OCompressLM(HFLM):
    """lm-eval's ``HFLM`` whose loglikelihood, rolling loglikelihood and generation requests run through a
    [`CompressedCache`][h2o_compress.cache.CompressedCache] (see the module docstring for what each request type does).

    Args:
        pretrained: an alias (``smollm2-135m``, the default), a local Hugging Face directory, a hub id (needs a
            network), all loaded by [`h2o_compress.load_model`][h2o_compress.load_model]; or an already-loaded causal LM (Python API), then
            with ``tokenizer``.
        tokenizer: the tokenizer of an already-loaded ``pretrained`` model.
        device: as [`h2o_compress.load_model`][h2o_compress.load_model] (default ``auto``); ignored for an already-loaded model.
        dtype: as [`h2o_compress.load_model`][h2o_compress.load_model] (``"auto"`` means its default); ignored for an already-loaded
            model.
        weights_bits: as [`h2o_compress.load_model`][h2o_compress.load_model] (default ``None``: 8 on CPU for the
            embedded model, else 16; ``weights_bits=16`` for fp32 on CPU); ignored for an already-loaded model.
        trust_remote_code: as [`h2o_compress.load_model`][h2o_compress.load_model]; ignored for an already-loaded model.
        batch_size: 1 (requests are scored one at a time).
        chunk_size: tokens per forward pass of rolling loglikelihood (1 = exact decode semantics).
        **kwargs: the fields of [`CompressionConfig`][h2o_compress.CompressionConfig] (``policy``, ``budget``, ``heavy_ratio``,
            ``sink_tokens``, ``kv_bits``, ``k_bits``, ``v_bits``, ``quant``, ``group_size``, ``residual``,
            ``rotate``, ``score_chunk_size``, ``attention_kernel``, ``layer_budgets``, ``head_budgets``,
            ``high_bits_fraction``) and the HFLM arguments of `HFLM_ARGS` (e.g. ``max_length``, ``add_bos_token``,
            ``softmax_dtype``).

    Raises:
        ConfigError: a bad or unknown model_arg (checked before the model is loaded), or a ``max_length`` beyond the
            loaded model's context window (checked before any request).
        ModelLoadError: the model cannot be loaded.
    """

    def __init__(self, pretrained=DEFAULT_MODEL, tokenizer=None, device: str = "auto", dtype=None,
                 trust_remote_code: bool = False, batch_size=1, chunk_size: int = 1, weights_bits: int | None = None,
                 **kwargs):
        self.compression = check_model_args(
            {"pretrained": pretrained, "tokenizer": tokenizer, "batch_size": batch_size, "chunk_size": chunk_size,
             "weights_bits": weights_bits, "device": device, "dtype": dtype, "trust_remote_code": trust_remote_code,
             **kwargs}
        )
        hflm_kwargs = {k: v for k, v in kwargs.items() if k in HFLM_ARGS}
        if isinstance(pretrained, str):
            model, tokenizer = load_model(pretrained, device=device, dtype=None if dtype == "auto" else dtype,
                                          trust_remote_code=trust_remote_code, weights_bits=weights_bits)
            self.model_name = pretrained
        else:
            if tokenizer is None:
                raise ConfigError("an already-loaded model passed as pretrained= needs its tokenizer=; allowed: both")
            model = pretrained
            self.model_name = getattr(model, "name_or_path", type(model).__name__)
        check_max_length(hflm_kwargs.get("max_length"), context_window(model))  # each request's cache is made for it
        self.chunk_size = chunk_size
        super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=1, **hflm_kwargs)

    # -- loglikelihood: context compressed at prefill, continuation scored against it ---------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        """``[(log p(continuation | compressed context), is_greedy)]`` for ``requests`` of
        ``((context, continuation) or None, context_ids, continuation_ids)``, in their order.

        A context longer than lm-eval allows (``len(context) + len(continuation) > max_length + 1``) is cut from the
        left, as ``HFLM`` does. Requests with the same (cut) context share one prefill.
        """
        from tqdm import tqdm

        groups: dict[tuple, list[int]] = {}
        for index, (_, context, continuation) in enumerate(requests):
            if not context or not continuation:
                raise ConfigError("a loglikelihood request with an empty context or continuation")  # lm-eval never sends one
            keep = max(1, self.max_length + 1 - len(continuation))
            groups.setdefault(tuple(context[-keep:]), []).append(index)
        results: list = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="h2o-compress loglikelihood")
        for context, indices in groups.items():
            cache, last_logits = self._compressed_context(list(context))
            for index in indices:
                key, _, continuation = requests[index]
                answer = self._score_continuation(cache, last_logits, len(context), continuation)
                results[index] = answer
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
                bar.update(1)
        bar.close()
        return results

    @torch.inference_mode()
    def _compressed_context(self, context: list[int]):
        """Prefill ``context`` through a fresh compressed cache (budget relative to its tokens); returns the cache and
        the next-token logits ``[1, vocab]``."""
        ids = torch.tensor([context], dtype=torch.long, device=self.device)
        cache = make_scored_cache(self.model, self.tokenizer, ids, self.compression, len(context),
                                  question_in_prompt=True)  # a request's context ends with its question
        return cache, extend_prompt(self.model, ids, cache)  # made for this model just above

    @torch.inference_mode()
    def _score_continuation(self, cache, last_logits: torch.Tensor, context_tokens: int, continuation: list[int]):
        """``(sum of log p(continuation tokens), every token greedy)`` with the continuation appended as one chunk to
        a frozen copy of ``cache`` (which is not changed)."""
        logits = last_logits[:, None]  # [1, 1, vocab]: predicts continuation[0]
        if len(continuation) > 1:
            frozen = cache.frozen_copy(context_tokens + len(continuation) - 1)
            chunk = torch.tensor([continuation[:-1]], dtype=torch.long, device=self.device)
            more = self.model(input_ids=chunk, past_key_values=frozen, use_cache=True).logits
            logits = torch.cat((logits, more), dim=1)
        log_probs = F.log_softmax(logits, dim=-1, dtype=self.softmax_dtype)[0]  # [continuation, vocab]
        targets = torch.tensor(continuation, dtype=torch.long, device=log_probs.device)
        greedy = bool((log_probs.argmax(-1) == targets).all())
        return float(log_probs.gather(1, targets[:, None]).sum()), greedy

    # -- rolling loglikelihood: each window streamed through a compressed cache -----------------------------------
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole text: lm-eval's disjoint windows of at most ``max_length`` tokens, each
        streamed through its own compressed cache ``chunk_size`` tokens per pass; the sum over the windows."""
        from tqdm import tqdm

        totals = []
        for request in tqdm(requests, disable=disable_tqdm or self.rank != 0, desc="h2o-compress rolling"):
            (text,) = request.args
            windows = map(lm_eval_utils.make_disjoint_window, lm_eval_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1,
            ))
            total = sum(self._stream_window(context, continuation) for context, continuation in windows)
            totals.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return totals

    @torch.inference_mode()
    def _stream_window(self, context: list[int], continuation: list[int]) -> float:
        """Sum of log p of the ``continuation`` tokens, reading ``context + continuation`` (cut to ``max_length + 1``
        from the left) through a fresh compressed cache ``chunk_size`` tokens at a time."""
        tokens = (context + continuation)[-(self.max_length + 1):]
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        first_scored = len(tokens) - len(continuation)  # index of the first token scored
        inputs = ids[:, :-1]
        cache = make_cache(self.model, self.compression, max_length=inputs.shape[1])
        total = torch.zeros((), dtype=torch.float64, device=self.device)

        def score(start: int, logits: torch.Tensor) -> None:  # position p predicts token p + 1
            log_probs = F.log_softmax(logits[0], dim=-1, dtype=self.softmax_dtype)
            targets = ids[0, start + 1 : start + 1 + log_probs.shape[0]]
            picked = log_probs.gather(1, targets[:, None])[:, 0]
            skip = max(0, first_scored - (start + 1))
            nonlocal total
            total = total + picked[skip:].double().sum()

        read_stream(self.model, cache, inputs, self.chunk_size, on_logits=score)
        return float(total)

    # -- generation: model.generate with the compressed cache ---------------------------------------------------
    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        """``HFLM._model_generate`` with a fresh [`CompressedCache`][h2o_compress.cache.CompressedCache] for ``max_length``
        tokens (context + ``max_gen_toks``) passed to ``model.generate`` as ``past_key_values``."""
        cache = make_cache(self.model, self.compression, max_length=int(max_length))
        return super()._model_generate(context, max_length, stop, past_key_values=cache, **generation_kwargs)

    def get_model_info(self) -> dict:
        """Parameters, dtype, the model name and the compression setting (no hub look-up)."""
        return {
            "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
            "model_dtype": str(self.model.dtype),
            "model_name": self.model_name,
            "compression": self.compression.to_dict(),
        }

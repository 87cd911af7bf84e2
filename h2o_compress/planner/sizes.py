"""Bytes of a setting: the KV cache (exact: the same layer and quantizer objects the cache is built from,
[`h2o_compress.cache.build_layers`][h2o_compress.cache.build_layers], at the end state of a [`h2o_compress.generate`][h2o_compress.generate] run; DESIGN.md §2,
Memory accounting), the weights (exact for 16-bit, bitsandbytes' formats for 8/4-bit), and the workspace (an
estimate of the largest forward pass, plus the Triton op's scratch and a compiled step's CUDA-graph pool)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch

from h2o_compress.attention.launch import decode_scratch_bytes, launch_for
from h2o_compress.cache import CompressedLayer, build_layers
from h2o_compress.cache.span import FULL_SPAN
from h2o_compress.config import CompressionConfig
from h2o_compress.utils.checks import is_integer
from h2o_compress.utils.errors import ConfigError, short
from h2o_compress.models import ModelDims
from h2o_compress.models.int4_linear import GROUP_SIZE as INT4_GROUP  # weights per bf16 step and zero (CPU 4-bit)
from h2o_compress.models.int8_linear import COMPUTE_DTYPE
from h2o_compress.policies import POLICIES
from h2o_compress.planner.known_models import ModelSpec
from h2o_compress.planner.states import StateTensor, state_bytes

WEIGHT_BITS = (16, 8, 4)


INT8_SCALE_DTYPE = COMPUTE_DTYPE  # the CPU int8 path's scales (bf16)
NF4_BLOCK = 64  # bitsandbytes' default 4-bit block: one fp32 absmax per 64 weights (no double quantization)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class CacheBytes:
    """What a [`CompressedCache`][h2o_compress.CompressedCache] holds, over all layers (bytes) and per layer/head (tokens).

    The cache allocates its buffers once, at the first token ([`h2o_compress.cache`][h2o_compress.cache]), so these figures hold
    from the prefill to the last decode step.

    Attributes:
        capacity: tokens kept per layer and KV head, on average over the layers (``None``: unbounded).
        kept: tokens held per layer and KV head after the run (``min(capacity, tokens fed)``).
        slots: slots of the first layer's store (``capacity - residual + 1``, or ``max_length - residual + 1``
            unbounded; with pyramid layer budgets each layer has its own).
        residual: slots of the full-precision ring window.
        packed: bytes of quantized (or 16-bit stored) keys and values, every slot.
        scales: bytes of scales, zero points and absmax values, every slot.
        window: bytes of the ring window's keys and values.
        scores: bytes of the fp32 H2O score accumulators (store and ring; bounded caches of scoring policies) and of
            the fp32 value norms of a policy that weighs values (``vatp``: one per slot).
        positions: bytes of the int32 positions (store and ring), of the 8-bit tokens' slot indices
            (``high_bits_fraction``; their low planes count as ``packed``) and of the int8 head tags of a head-adaptive
            layer's slot pool (``head_budgets="adaptive"``).
        counters: bytes of the per-layer counters (tokens seen, first real token per sequence, finite flag).
        states: bytes of a hybrid model's constant conv and recurrent states held by the cache (its
            linear-attention, SSM and convolution layers, uncompressed; `h2o_compress.planner.states`): the same
            at every context length.
        model_states: bytes of the constant states a model keeps in its own modules rather than in the cache
            (RecurrentGemma): not in ``total`` (``cache.nbytes()`` does not see them), counted by the plan's total.
    """

    capacity: int | None
    kept: int
    slots: int
    residual: int
    packed: int
    scales: int
    window: int
    scores: int
    positions: int
    counters: int
    states: int = 0
    model_states: int = 0

    @property
    def total(self) -> int:
        """Everything ``cache.nbytes()`` counts (bytes): the attention layers' and the constant states."""
        return self.packed + self.scales + self.window + self.scores + self.positions + self.counters + self.states

    @property
    def all_states(self) -> int:
        """The constant states of the batch wherever they are held (bytes): ``states + model_states``."""
        return self.states + self.model_states


_CATEGORIES = (
    ("scores", ("scores", "value_norms")), ("positions", ("positions", "refine.slots", "owner")), ("window", ("ring.keys", "ring.values")),
    ("packed", (".data", ".x")), ("scales", (".scale_zero", ".absmax")), ("counters", ("seen", "first_real", "finite", "consistent")),
)


def cache_bytes(
    dims: ModelDims, config: CompressionConfig, batch: int, prompt_len: int, decode_steps: int = 0,
    max_length: int | None = None, kv_dtype: torch.dtype = torch.float16, states: tuple[StateTensor, ...] = (),
) -> CacheBytes:
    """Exact ``cache.nbytes()`` of a cache built for ``max_length`` tokens, after a ``prompt_len``-token prefill
    and ``decode_steps`` one-token steps (the buffers are allocated once, so the bytes do not change with them).

    ``generate`` with ``n`` new tokens makes ``n - 1`` decode steps and builds the cache for ``max_length =
    prompt + n``. Built from a real layer allocated on the ``meta`` device (no memory): the same code sizes the
    planner's figures and the cache's buffers.

    Args:
        dims: KV geometry of the model.
        config: the compression setting.
        batch: sequences.
        prompt_len: tokens of the prefill step.
        decode_steps: number of one-token steps after it.
        max_length: tokens the cache was built for (default ``prompt_len + decode_steps + 1``).
        kv_dtype: dtype of the keys/values the model produces (its compute dtype).
        states: a hybrid model's constant state tensors ([`model_states`][h2o_compress.planner.model_states] of its
            config; a [`ModelSpec`][h2o_compress.planner.ModelSpec] carries them): ``()`` counts none.

    Raises:
        ConfigError: a group size not dividing ``head_dim``.
    """
    if max_length is None:
        max_length = prompt_len + decode_steps + 1
    capacity = config.kept_tokens(max_length)
    empty = torch.empty(batch, dims.kv_heads, 0, dims.head_dim, dtype=kv_dtype, device="meta")
    sizes = {name: 0 for name, _ in _CATEGORIES}
    # every layer alike: size one, count it num_layers times ("global" spreads the same total by the scores, and a
    # layer's bytes are affine in its capacity, so the total is uniform's)
    # a sliding or chunked layer holds at most its window (cache/span.py): one layer sized per distinct span
    if config.layer_budgets in ("uniform", "global"):
        spans = Counter(dims.spans or (FULL_SPAN,) * dims.num_layers)
        layers = [build_layers(config, 1, dims.head_dim, capacity, max_tokens=max_length, spans=(span,),
                               value_dim=dims.value_head_dim)[0]
                  for span in spans]
        repeats = list(spans.values())
    else:
        layers = build_layers(config, dims.num_layers, dims.head_dim, capacity, max_tokens=max_length,
                              spans=dims.spans, value_dim=dims.value_head_dim)
        repeats = [1] * len(layers)
    for layer, repeat in zip(layers, repeats):
        if not isinstance(layer, CompressedLayer):  # a hybrid's constant-state layer: sized from ``states``
            continue
        layer.lazy_initialization(empty, empty)
        for name, tensor in layer.tensors().items():
            category = next(c for c, keys in _CATEGORIES if any(name.endswith(k) or name == k for k in keys))
            sizes[category] += tensor.numel() * tensor.element_size() * repeat
    seen = prompt_len + decode_steps
    kept = seen if capacity is None else min(capacity, seen)
    first = next(layer for layer in layers if isinstance(layer, CompressedLayer))
    held, outside = state_bytes(states, batch, kv_dtype)
    return CacheBytes(capacity=capacity, kept=kept, slots=first.store.slots, residual=first.setting.residual, **sizes,
                      states=held, model_states=outside)


def weight_bytes(spec: ModelSpec, weights_bits: int, dtype: torch.dtype, backend: str = "bitsandbytes") -> int:
    """Bytes of the model's weights: exact for a loaded model and for unquantized (``weights_bits=16``) ones.

    8 bits, ``backend="bitsandbytes"`` (CUDA): LLM.int8 (``load_in_8bit``): one byte per Linear weight + one fp32
    scale per output row; the output head stays in ``dtype``. 8 bits, ``backend="cpu"`` (torch's packed int8
    kernel, `h2o_compress.models.int8_linear`): one byte per Linear weight, the output head's included, + one bf16
    scale per output row; a head tied to the embeddings gets its own int8 copy (the embedding stays in ``dtype``).
    4 bits, ``backend="bitsandbytes"``: NF4/FP4 (``load_in_4bit``): half a byte per Linear weight + one fp32
    absmax per 64 weights. 4 bits, ``backend="cpu"`` (torch's packed int4 kernel,
    `h2o_compress.models.int4_linear`): half a byte per decoder Linear weight + a bf16 step and zero per 32 of
    them (every layer's shape taken by the kernel: out_features by 16, in_features by 32), the head in int8 as
    for 8 bits.
    Embeddings, norms and biases stay in ``dtype``.

    Raises:
        ConfigError: ``weights_bits`` not 16, 8 or 4, or an unknown ``backend``.
    """
    if not is_integer(weights_bits) or weights_bits not in WEIGHT_BITS:
        raise ConfigError(f"weights_bits={short(weights_bits)} is not supported; allowed: 16, 8, 4")
    if backend not in ("bitsandbytes", "cpu"):
        raise ConfigError(f"backend={short(backend)} is not supported; allowed: bitsandbytes, cpu")
    if spec.loaded_bytes is not None:
        return spec.loaded_bytes
    size = _element_size(dtype)
    if weights_bits == 16:
        return spec.num_parameters * size
    rest = (spec.num_parameters - spec.linear_parameters) * size
    if backend == "cpu":
        scale = _element_size(INT8_SCALE_DTYPE)
        head = spec.head_parameters + scale * spec.head_rows  # the head's int8 copy and its scales
        if not spec.head_tied:  # an untied head's fp weight is replaced, not kept
            rest -= spec.head_parameters * size
        if weights_bits == 4:  # half a byte per weight + a bf16 step and zero per group of INT4_GROUP weights
            return rest + spec.linear_parameters // 2 + 2 * scale * (spec.linear_parameters // INT4_GROUP) + head
        return rest + spec.linear_parameters + scale * spec.linear_rows + head
    if weights_bits == 8:
        return rest + spec.linear_parameters + 4 * spec.linear_rows
    return rest + math.ceil(spec.linear_parameters / 2) + 4 * math.ceil(spec.linear_parameters / NF4_BLOCK)


def forward_peak_bytes(spec: ModelSpec, config: CompressionConfig, batch: int, queries: int, keys: int,
                       size: int) -> int:
    """Estimated live bytes of one forward pass of ``batch`` x ``queries`` new tokens against ``keys`` keys per
    layer, with activations of ``size`` bytes per element: the residual stream, the MLP intermediates, the
    attention scores or the keys/values a layer materialises, and the last position's logits."""
    d, tokens = spec.dims, batch * queries
    residual_stream = 4 * tokens * spec.hidden_size * size  # hidden states, normed input, attention/MLP outputs
    qkv = tokens * (d.num_heads + 2 * d.kv_heads) * d.head_dim * size
    # one layer's keys/values as the cache returns them, plus their copies repeated to the query heads (GQA)
    kv = 2 * batch * keys * d.head_dim * (d.kv_heads + (d.num_heads if d.num_heads != d.kv_heads else 0)) * size
    dequant = 2 * batch * keys * d.kv_heads * d.head_dim * 4 if config.quantized else 0  # fp32 (de)quantize temporaries
    scoring = 0
    if POLICIES[config.policy].needs_scores and queries > 1:
        # the prefill's scoring goes over one KV head's query group at a time: two fp32 [group x chunk x keys]
        # tensors and that head's fp32 keys (attention_probability_sums); a decode step's sums come from the kernel
        chunk = min(config.score_chunk_size, queries)
        group = d.num_heads // d.kv_heads
        scoring = batch * keys * 4 * (2 * group * chunk + d.head_dim)
    mlp = 3 * tokens * spec.intermediate_size * size
    logits = batch * spec.vocab_size * size  # generate() keeps the logits of the last position only
    return residual_stream + max(qkv + kv + dequant + scoring, mlp, logits)


def graph_pool_bytes(spec: ModelSpec, config: CompressionConfig, batch: int, kept: int, dtype: torch.dtype,
                     fused: bool) -> int:
    """Estimated bytes of the CUDA-graph pool of the compiled decode step (``mode="reduce-overhead"``).

    A captured step allocates its intermediate buffers (and its logits output) from the graph's private pool, which
    stays reserved while the graph lives, beside the memory the eager prefill uses: so it adds to the prefill's
    peak instead of sharing it. Estimated as one decode forward pass (1 query per sequence): with the Triton op
    (``fused``) the cache is read in place (its scratch is counted by [`workspace_bytes`][h2o_compress.planner.workspace_bytes]), without it the step
    materialises the ``kept + 1`` keys and values as attention reads them. An estimate: the pool itself is
    measured on a GPU by ``benchmarks/gpu_throughput.py`` (``graph_pool_bytes`` against this figure).
    """
    return forward_peak_bytes(spec, config, batch, 1, 0 if fused else kept + 1, _element_size(dtype))


def runs_decode_op(config: CompressionConfig, adaptive: bool) -> bool:
    """Whether a CUDA cache with ``config`` decodes through the Triton op (and keeps its per-layer scratch): uniform
    heads (not ``adaptive``: a head-adaptive layer that evicts), no mixed precision, 16 bits or the ``int`` formats
    (the bitsandbytes formats decode eagerly in the torch form), and ``attention_kernel`` other than ``torch``."""
    eager_only = not config.compilable
    return (not adaptive and config.high_bits_fraction == 0 and not eager_only
            and config.attention_kernel != "torch")


def workspace_bytes(spec: ModelSpec, config: CompressionConfig, batch: int, prompt_len: int, kept: int,
                    dtype: torch.dtype, slots: int | None = None, residual: int = 0, compiled: bool = False,
                    prefill_batch: int | None = None) -> int:
    """Estimated activation/workspace bytes: the larger of the prefill pass (``prompt_len`` queries) and a
    decode step (1 query against ``kept + 1`` keys), plus, given the store's ``slots`` and the ring's
    ``residual``, the scratch every layer of a CUDA cache keeps for the Triton decode op
    (`h2o_compress.attention.launch.decode_scratch_bytes`, for an H100/H200's 132 SMs; a CPU cache does not
    allocate it; a head-adaptive cache, mixed precision and the bitsandbytes formats neither: they decode in the
    torch form, a head-adaptive one reading ``kv_heads x`` the kept tokens per head),
    plus, when ``compiled``, the CUDA-graph pool of the compiled decode step ([`graph_pool_bytes`][h2o_compress.planner.graph_pool_bytes]; none for
    the bitsandbytes formats, which decode eagerly).

    ``prefill_batch``: sequences prefilled together (``None``: the whole ``batch``; a batch job of
    [`h2o_compress.generate_batch`][h2o_compress.generate_batch] prefills 1 at a time).

    The prefill counts its largest chunk (`prefill_pass`: ``prefill_chunk_size`` queries against the capacity plus
    the chunk, or the whole prompt where nothing is evicted), not the whole prompt at once. Counts the residual
    stream, q/k/v, one layer's keys/values as attention sees them, fp32 (de)quantization temporaries, H2O's chunked
    fp32 score computation (one KV head's query group at a time), the MLP intermediates and the logits. Assumes
    memory-efficient attention (no ``queries x keys`` matrix, no padding mask); excludes the CUDA context and
    allocator fragmentation (leave ~0.5-1 GiB for them).
    """
    size = _element_size(dtype)
    scratch = 0
    adaptive = config.head_budgets == "adaptive" and config.capacity(prompt_len + 1) is not None
    eager_only = not config.compilable  # bitsandbytes formats: torch form, never compiled
    fused = slots is not None and runs_decode_op(config, adaptive)
    if adaptive:  # torch form only (no Triton scratch); every head's attention reads the whole pool
        kept *= spec.dims.kv_heads
    elif fused:
        d = spec.dims
        with_scores = POLICIES[config.policy].needs_scores and config.capacity(prompt_len + 1) is not None
        block = launch_for(config.key_bits, config.value_bits).block
        attending = d.num_layers - sum(span.stateful for span in d.spans)  # a hybrid's state layers keep none
        scratch = attending * decode_scratch_bytes(
            batch, d.num_heads, d.kv_heads, d.head_dim, slots, residual, with_scores, block_tokens=block)
    pool = graph_pool_bytes(spec, config, batch, kept, dtype, fused) if compiled and not eager_only else 0
    queries, keys = prefill_pass(config, prompt_len, kept)
    return scratch + pool + max(
        forward_peak_bytes(spec, config, min(batch, prefill_batch or batch), queries, keys, size),
        forward_peak_bytes(spec, config, batch, 1, kept + 1, size),
    )


def prefill_pass(config: CompressionConfig, prompt_len: int, kept: int) -> tuple[int, int]:
    """The largest forward pass of a ``prompt_len``-token prefill as `h2o_compress.runtime.prefill` runs it, in
    tokens: ``(queries, keys)``. The prompt goes through in chunks of ``config.prefill_chunk_size`` tokens (0: one
    pass), and a cache that evicts holds at most its ``kept`` tokens per layer (the capacity) plus the chunk when
    the chunk's attention runs; one that keeps everything holds the whole prompt at the last chunk."""
    chunk = config.prefill_chunk_size or prompt_len
    queries = min(chunk, prompt_len)
    return queries, min(prompt_len, kept + queries)

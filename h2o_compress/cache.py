"""`CompressedCache`: a transformers ``Cache`` whose layers evict (H2O and friends) and quantize.

Each layer holds, per sequence and KV head, the kept tokens in their original order:

    [ stored (quantized, oldest) | residual (full precision, newest ``residual`` tokens) ]

Per forward step: ``update`` appends the new keys/values to the residual and returns every kept token
(stored ones dequantized); the registered attention function computes the output and calls
``after_attention`` with the attention probabilities; that accumulates the scores, evicts down to the
capacity, and quantizes the tokens that leave the residual window, each exactly once (DESIGN.md §1-2).
"""

from __future__ import annotations

import importlib.util
import os

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .attention import announce, withdraw
from .config import CompressionConfig
from .errors import CacheStateError, ConfigError, InputError
from .eviction import EvictionPolicy, make_policy
from .kernels import power_of_two
from .quantization import IntQuantizer, KVQuantizer, NoQuantizer, StoredTensor, make_quantizer
from .quantization.base import gather_tokens


class CompressedLayer(CacheLayerMixin):
    """The compressed KV cache of one attention layer.

    Tensors held, per sequence and KV head:

    - ``stored_keys``/``stored_values`` (:class:`StoredTensor`, ``[batch, kv_heads, slots, ...]``): a buffer of
      ``slots`` tokens (quantized, or in the model dtype for 16-bit caches) of which the first ``stored_length``
      are held, in no particular order once eviction has run;
    - ``slot_info`` (:class:`StoredTensor`, same slots): ``"position"`` (int32 absolute position of each stored
      token; bounded caches) and ``"score"`` (fp32 accumulated attention; policies that read scores);
    - ``residual_keys``/``residual_values`` (``[batch, kv_heads, residual, head_dim]``, 16-bit, quantized caches
      only) and their fp32 ``residual_scores``: the newest tokens, in order.

    Bounded caches allocate their buffer once (``capacity - residual`` slots when quantized, ``capacity + 1``
    when 16-bit: the new token is written into the buffer before attention). A decode step that evicts one token
    does it in place, as FlexGen's H2O does: the victim's slot takes the last stored token (O(1) per sequence and
    head), and tokens leaving the residual window are written into free slots; no step copies O(capacity) data.
    Other steps (prefill, multi-token chunks, left padding held) gather into a fresh buffer.

    Args:
        layer_idx: index of the model layer (the side-channel key).
        policy: eviction policy.
        capacity: tokens kept per sequence and KV head, ``None`` for no eviction.
        key_quantizer, value_quantizer: storage formats of keys and values.
        residual: newest tokens always kept in full precision when quantizing; the window holds between
            ``residual`` and ``2 x residual - 1`` tokens and is quantized in blocks (capped at half the policy's
            recent window, so the window is never evicted and always reaches its flush size).
        score_chunk_size: queries per chunk for prefill scoring.
        attention_kernel: ``auto``, ``torch`` or ``triton`` (see :class:`CompressionConfig`); decided for the layer
            when it sees its first keys (:meth:`uses_fused_kernel`).
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(
        self,
        layer_idx: int,
        policy: EvictionPolicy,
        capacity: int | None,
        key_quantizer: KVQuantizer,
        value_quantizer: KVQuantizer,
        residual: int = 0,
        score_chunk_size: int = 256,
        attention_kernel: str = "auto",
    ):
        super().__init__()
        self.attention_kernel = attention_kernel
        self.layer_idx, self.policy, self.capacity = layer_idx, policy, capacity
        self.key_quantizer, self.value_quantizer = key_quantizer, value_quantizer
        self.quantized = key_quantizer.bits < 16 or value_quantizer.bits < 16
        if not self.quantized:
            residual = 0
        elif capacity is not None:  # the window must reach 2 x residual (to be quantized) inside the recent window
            residual = min(residual, policy.recent_window(capacity) // 2)
        self.residual = residual
        self.score_chunk_size = score_chunk_size
        self.reset()

    # -- state ---------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop every token and score; the layer can start a new prompt."""
        self.stored_keys: StoredTensor | None = None
        self.stored_values: StoredTensor | None = None
        self.slot_info: StoredTensor | None = None
        self.stored_length = 0
        self.residual_keys: torch.Tensor | None = None
        self.residual_values: torch.Tensor | None = None
        self.residual_scores: torch.Tensor | None = None
        self.leading_pads: torch.Tensor | None = None  # [batch] left-padding tokens held, None when there are none
        self.seen_tokens = 0
        self.returned_keys = None
        self.fused_step = False  # this step's attention runs the fused kernel over the stored tokens
        self.finite: torch.Tensor | None = None  # CUDA decode steps: were all keys/values finite (checked lazily)
        self.bound_module = None  # weakref to the attention module that used this layer first
        self.is_initialized = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        # The residual window of a quantized cache is 16-bit even for fp32 models: its bytes count (DESIGN.md §2).
        self.residual_dtype = torch.float16 if self.quantized and self.dtype == torch.float32 else self.dtype
        # Tokens are held in each quantizer's basis (Hadamard or none); attention folds it into q and the output.
        self.key_basis = self.key_quantizer.rotation(self.device)
        self.value_basis = self.value_quantizer.rotation(self.device)
        self.batch, self.kv_heads, _, self.head_dim = key_states.shape
        self.fused = self.uses_fused_kernel()
        self.is_initialized = True

    def uses_fused_kernel(self) -> bool:
        """Whether one-token steps run :func:`~h2o_compress.kernels.decode_attention.fused_decode_attention`
        (``attention_kernel``: ``triton`` always, ``auto`` on CUDA when triton is installed and the format allows).

        Raises:
            ConfigError: ``triton`` asked for a format the kernel does not read (bitsandbytes formats, a
                ``head_dim`` that is not a power of two >= 16), without triton installed, or on CPU outside the
                Triton interpreter (``TRITON_INTERPRET=1``).
        """
        if self.attention_kernel == "torch":
            return False
        dim, formats = self.head_dim, (IntQuantizer, NoQuantizer)
        readable = power_of_two(dim, 16) and all(
            type(q) in formats for q in (self.key_quantizer, self.value_quantizer)
        )
        has_triton = importlib.util.find_spec("triton") is not None
        if self.attention_kernel == "auto":
            return readable and has_triton and self.device.type == "cuda"
        if not readable:
            raise ConfigError(
                f"attention_kernel='triton' reads int4/int8/16-bit storage with a power-of-two head_dim >= 16; got "
                f"{type(self.key_quantizer).__name__}/{type(self.value_quantizer).__name__}, head_dim={dim}; "
                "allowed here: attention_kernel='torch' or 'auto'"
            )
        if not has_triton:
            raise ConfigError("attention_kernel='triton' needs the triton package (pip install triton)")
        if self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError(
                f"attention_kernel='triton' runs on CUDA devices (got {self.device}); on CPU only under the Triton "
                "interpreter (TRITON_INTERPRET=1, for tests); allowed here: 'torch' or 'auto'"
            )
        return True

    @property
    def slots(self) -> int:
        """Tokens the stored buffer has room for (allocated), per sequence and KV head."""
        return 0 if self.stored_keys is None else len(self.stored_keys)

    def target_slots(self, needed: int) -> int:
        """Slots to allocate when the buffer must hold ``needed`` tokens: the steady-state size of a bounded
        cache (``capacity - residual`` quantized, ``capacity + 1`` at 16 bits), else exactly ``needed``."""
        if self.capacity is None:
            return needed
        return max(needed, self.capacity - self.residual if self.quantized else self.capacity + 1)

    @property
    def residual_length(self) -> int:
        return 0 if self.residual_keys is None else self.residual_keys.shape[2]

    def kept_length(self) -> int:
        """Tokens held now, per sequence and KV head."""
        return self.stored_length + self.residual_length

    @property
    def scores(self) -> torch.Tensor | None:
        """fp32 ``[batch, kv_heads, kept]`` accumulated attention of the tokens held (stored slots, then the
        residual window), or ``None`` for policies without scores."""
        if self.slot_info is None or "score" not in self.slot_info.parts:
            return self.residual_scores
        stored = self.slot_info.parts["score"][:, :, : self.stored_length]
        return stored if self.residual_scores is None else torch.cat((stored, self.residual_scores), dim=2)

    def positions(self) -> torch.Tensor:
        """int64 ``[batch, kv_heads, kept]`` absolute positions of the tokens held, in the order of :attr:`scores`
        and of the keys :meth:`update` returns."""
        seen, window = self.seen_tokens, self.residual_length
        residual = torch.arange(seen - window, seen, device=self.device).expand(self.batch, self.kv_heads, window)
        if self.slot_info is not None and "position" in self.slot_info.parts:
            stored = self.slot_info.parts["position"][:, :, : self.stored_length].long()
        else:  # unbounded caches never evict: stored tokens are 0 .. stored_length - 1
            stored = torch.arange(self.stored_length, device=self.device).expand(self.batch, self.kv_heads, -1)
        return torch.cat((stored, residual), dim=2)

    # -- transformers' layer API -----------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``[batch, kv_heads, new, head_dim]`` keys/values; return every kept token (dequantized), in
        ``key_basis``/``value_basis`` when those are set (the ``h2o_compress`` attention function undoes them).

        Raises:
            CacheStateError: the previous step's attention did not run through ``h2o_compress`` attention,
                or the batch / head shape changed.
        """
        if self.returned_keys is not None:
            self.returned_keys = None
            withdraw(self.layer_idx)
            raise CacheStateError(
                f"layer {self.layer_idx}: attention of the previous step did not go through the 'h2o_compress' "
                "attention function (or the cache is used by another model than the one it was made for); build "
                "the cache with h2o_compress.make_cache(model, ...), which switches that model to it"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif key_states.shape[0] != self.batch or key_states.shape[1] != self.kv_heads or key_states.shape[3] != self.head_dim:
            raise CacheStateError(
                f"layer {self.layer_idx}: cache holds batch={self.batch}, kv_heads={self.kv_heads}, "
                f"head_dim={self.head_dim} but got batch={key_states.shape[0]}, kv_heads={key_states.shape[1]}, "
                f"head_dim={key_states.shape[3]}; use a new cache (or cache.reset())"
            )
        finite = torch.isfinite(torch.sum(key_states, dtype=torch.float32) + torch.sum(value_states, dtype=torch.float32))
        if key_states.device.type == "cuda" and key_states.shape[2] == 1:
            # No host sync per layer and step on a GPU: CompressedCache checks these flags once, at the next step.
            self.finite = finite if self.finite is None else self.finite & finite
        elif not bool(finite):
            raise InputError(
                f"layer {self.layer_idx}: keys or values are not finite (NaN or Inf); check the inputs and the model "
                "weights: a non-finite token would poison every later step"
            )
        first = self.seen_tokens
        self.seen_tokens += key_states.shape[2]
        if self.key_basis is not None:
            key_states = key_states.float() @ self.key_basis
        if self.value_basis is not None:
            value_states = value_states.float() @ self.value_basis
        key_states, value_states = key_states.to(self.residual_dtype), value_states.to(self.residual_dtype)
        # One-token steps with no padding held can run the fused kernel on the stored tokens as they are.
        self.fused_step = self.fused and key_states.shape[2] == 1 and self.leading_pads is None
        if not self.quantized:  # 16-bit: straight into the buffer; attention reads a view of it
            self._append(self.key_quantizer.quantize(key_states), self.value_quantizer.quantize(value_states), first)
            keys = self.stored_keys.parts["x"][:, :, : self.stored_length]
            values = self.stored_values.parts["x"][:, :, : self.stored_length]
        else:
            if self.residual_keys is None:
                self.residual_keys, self.residual_values = key_states, value_states
            else:
                self.residual_keys = torch.cat((self.residual_keys, key_states), dim=2)
                self.residual_values = torch.cat((self.residual_values, value_states), dim=2)
            if self.fused_step:  # attention reads the packed tokens itself: hand back shape-only stand-ins
                shape = (self.batch, self.kv_heads, self.kept_length(), self.head_dim)
                stand_in = torch.zeros((), dtype=self.dtype, device=self.device)
                keys, values = stand_in.expand(shape), stand_in.expand(shape)
            else:
                keys = self._assemble(self.key_quantizer, self.stored_keys, self.residual_keys)
                values = self._assemble(self.value_quantizer, self.stored_values, self.residual_values)
        self.returned_keys = keys
        announce(self.layer_idx, self)
        return keys, values

    def fused_attention(self, query: torch.Tensor, scaling: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This step's attention through the fused kernel: ``query`` ``[batch, q_heads, 1, head_dim]`` (already in
        ``key_basis``) over the stored tokens and the residual window. Returns the output ``[batch, q_heads, 1,
        head_dim]`` (in ``value_basis``) and, for policies that read scores, the fp32 probability sums ``[batch,
        kv_heads, kept]``."""
        from .kernels.decode_attention import fused_decode_attention

        stored = self.stored_length
        group = getattr(self.key_quantizer, "group_size", None) or getattr(self.value_quantizer, "group_size", 32)
        return fused_decode_attention(
            query,
            self.stored_keys.narrow(stored) if stored else None,
            self.stored_values.narrow(stored) if stored else None,
            self.key_quantizer.bits, self.value_quantizer.bits, group,
            self.residual_keys, self.residual_values,
            self.head_dim**-0.5 if scaling is None else scaling,
            self.policy.needs_scores,
        )

    def _assemble(self, quantizer: KVQuantizer, stored: StoredTensor | None, window: torch.Tensor) -> torch.Tensor:
        """``[batch, kv_heads, stored + window, head_dim]`` in the model dtype: stored tokens dequantized into one
        buffer, then the full-precision window (no concatenation)."""
        split = self.stored_length
        if split == 0:
            return window.to(self.dtype)
        out = torch.empty(self.batch, self.kv_heads, split + window.shape[2], self.head_dim, dtype=self.dtype, device=self.device)
        quantizer.dequantize_into(stored.narrow(split), out[:, :, :split])
        out[:, :, split:].copy_(window)
        return out

    def _append(
        self, keys: StoredTensor, values: StoredTensor, first: int | torch.Tensor, scores: torch.Tensor | None = None
    ) -> None:
        """Write stored-format tokens at positions ``first ..`` (or at the positions ``first`` ``[batch, kv_heads,
        new]``) and their ``scores`` (default 0) behind the stored ones, growing the buffer to :meth:`target_slots`
        only when it is full."""
        start, new = self.stored_length, len(keys)
        if self.capacity is None and self.stored_keys is not None:  # unbounded: no slack, one cat per tensor
            self.stored_keys, self.stored_values = self.stored_keys.cat(keys), self.stored_values.cat(values)
            if self.slot_info is not None:  # scores only: nothing is evicted, so no positions
                added = torch.zeros(self.batch, self.kv_heads, new, device=self.device) if scores is None else scores
                self.slot_info = self.slot_info.cat(StoredTensor({"score": added}))
            self.stored_length += new
            return
        if self.stored_keys is None:
            slots = self.target_slots(new)
            self.stored_keys, self.stored_values = keys.resized(0, slots), values.resized(0, slots)
            info = {}
            if self.capacity is not None:
                info["position"] = torch.empty(self.batch, self.kv_heads, slots, dtype=torch.int32, device=self.device)
            if self.policy.needs_scores:
                info["score"] = torch.empty(self.batch, self.kv_heads, slots, dtype=torch.float32, device=self.device)
            self.slot_info = StoredTensor(info) if info else None
        elif start + new > self.slots:
            slots = self.target_slots(start + new)
            for name in ("stored_keys", "stored_values", "slot_info"):
                if getattr(self, name) is not None:
                    setattr(self, name, getattr(self, name).resized(start, slots))
        self.stored_keys.write(start, keys)
        self.stored_values.write(start, values)
        if self.slot_info is not None:
            info = self.slot_info.parts
            if "position" in info:
                if isinstance(first, int):
                    first = torch.arange(first, first + new, device=self.device)
                info["position"][:, :, start : start + new] = first
            if "score" in info:
                target = info["score"][:, :, start : start + new]
                target.zero_() if scores is None else target.copy_(scores)
        self.stored_length += new

    def after_attention(self, probability_sums: torch.Tensor | None, padding: torch.Tensor | None = None) -> None:
        """Accumulate scores (fp32 ``[batch, kv_heads, kept]``, keys in the order :meth:`update` returned them),
        evict down to capacity, quantize the tokens leaving the residual window. ``padding`` ``[batch | 1, kept]``
        marks keys no query may see (left padding), or is ``None`` when there is none."""
        self.returned_keys = None
        self.fused_step = False
        if padding is not None:
            pads = padding.sum(-1).expand(self.batch)
            self.leading_pads = pads if bool(pads.any()) else None
            if probability_sums is not None and self.leading_pads is not None:  # padding is evicted first
                probability_sums = probability_sums.masked_fill(padding.view(-1, 1, padding.shape[-1]), float("-inf"))
        if probability_sums is not None:
            stored = self.stored_length
            if stored:
                self.slot_info.parts["score"][:, :, :stored] += probability_sums[:, :, :stored]
            window = probability_sums[:, :, stored:]
            if window.shape[2]:
                if self.residual_scores is not None:
                    grown = window.shape[2] - self.residual_scores.shape[2]
                    window = torch.nn.functional.pad(self.residual_scores, (0, grown)).add_(window)
                self.residual_scores = window
        if self._evict_one_in_place():
            self._quantize_overflow()
            return
        if self.stored_length == 0:
            self._evict()  # prefill: evict before quantizing, so evicted tokens are never quantized
        self._quantize_overflow()
        self._evict()

    def _evict_one_in_place(self) -> bool:
        """The decode step: one token over capacity, all of it in the stored buffer's reach. Picks the victim
        with the policy's rule (lowest score outside the sinks and the recent window, ties evict the newer
        token) and moves the last stored token into its slot. Returns ``False`` (nothing done) otherwise."""
        capacity, stored = self.capacity, self.stored_length
        if capacity is None or self.kept_length() != capacity + 1 or self.leading_pads is not None:
            return False
        sinks, recent = min(self.policy.sink_tokens, capacity), self.policy.recent_window(capacity)
        if self.residual_length > recent or stored <= sinks:
            return False
        position = self.slot_info.parts["position"][:, :, :stored]
        if self.policy.needs_scores:
            scores = self.slot_info.parts["score"][:, :, :stored]
            priority = self.policy.ranking_scores(scores, position, self.seen_tokens).clone()
        else:
            priority = torch.zeros(position.shape, device=self.device)
        if recent:
            priority.masked_fill_(position >= self.seen_tokens - recent, float("inf"))
        priority[:, :, :sinks] = float("inf")  # sinks sit in the first slots: stored in order, never moved
        lowest = priority == priority.amin(-1, keepdim=True)
        victim = torch.where(lowest, position, -1).argmax(-1)  # the newest of the lowest: ties keep the older
        for store in (self.stored_keys, self.stored_values, self.slot_info):
            store.move(stored - 1, victim)
        self.stored_length -= 1
        return True

    def _evict(self) -> None:
        """Evict down to capacity by gathering the kept tokens (in position order) into a fresh buffer."""
        length = self.kept_length()
        if self.capacity is None or length <= self.capacity:
            return
        stored, window = self.stored_length, self.residual_length
        order = None  # physical slot of the i-th oldest stored token
        if stored and "position" in self.slot_info.parts:
            order = self.slot_info.parts["position"][:, :, :stored].argsort(dim=-1)
        scores = self.scores
        if scores is not None:
            positions = self.positions()
            if order is not None:
                scores = torch.cat((scores[:, :, :stored].gather(2, order), scores[:, :, stored:]), dim=2)
                positions = torch.cat((positions[:, :, :stored].gather(2, order), positions[:, :, stored:]), dim=2)
            scores = self.policy.ranking_scores(scores, positions, self.seen_tokens)
        keep = self.policy.keep_indices(scores, length, self.capacity, self.leading_pads).to(self.device)
        if keep.dim() == 1:
            keep = keep.expand(self.batch, self.kv_heads, -1)
        elif keep.shape[1] != self.kv_heads:
            keep = keep.expand(-1, self.kv_heads, -1)
        if self.leading_pads is not None:
            pads = (keep[:, 0, :] < self.leading_pads[:, None]).sum(-1)
            self.leading_pads = pads if bool(pads.any()) else None
        if window and stored == 0:  # prefill of a quantized cache: only the window holds tokens
            self.residual_keys = gather_tokens(self.residual_keys, keep)
            self.residual_values = gather_tokens(self.residual_values, keep)
            if self.residual_scores is not None:
                self.residual_scores = gather_tokens(self.residual_scores, keep)
            self._quantize_overflow(keep + (self.seen_tokens - length))  # the window is no longer contiguous
            return
        # The residual (<= recent window) is always kept: the first capacity - window indices are stored ones.
        keep = keep[..., : self.capacity - window]
        if order is not None:
            keep = order.gather(2, keep)
        slots = self.target_slots(keep.shape[2])
        self.stored_keys = self.stored_keys.select(keep, slots)
        self.stored_values = self.stored_values.select(keep, slots)
        if self.slot_info is not None:
            self.slot_info = self.slot_info.select(keep, slots)
        self.stored_length = keep.shape[2]

    def _quantize_overflow(self, positions: torch.Tensor | None = None) -> None:
        """Quantize the oldest residual tokens once the window reaches ``2 x residual`` (or more) tokens, keeping
        the newest ``residual``: quantization runs in blocks (KIVI, arXiv 2402.02750 §3.3), not every step.
        ``positions`` ``[batch, kv_heads, window]``: where the window's tokens sit, when they are not the newest
        ``window`` positions (right after a prefill eviction)."""
        window = self.residual_length
        overflow = window - self.residual
        if not self.quantized or overflow <= 0 or (self.residual and window < 2 * self.residual):
            return
        keys = self.key_quantizer.quantize(self.residual_keys[:, :, :overflow])
        values = self.value_quantizer.quantize(self.residual_values[:, :, :overflow])
        scores = None if self.residual_scores is None else self.residual_scores[:, :, :overflow]
        first = self.seen_tokens - window if positions is None else positions[:, :, :overflow]
        self._append(keys, values, first, scores)
        self.residual_keys = self.residual_keys[:, :, overflow:].clone()
        self.residual_values = self.residual_values[:, :, overflow:].clone()
        if self.residual_scores is not None:
            self.residual_scores = self.residual_scores[:, :, overflow:].clone()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)``: kept tokens + new queries; the offset makes every kept token visible."""
        kept = self.kept_length()
        return kept + query_length, self.seen_tokens - kept

    def get_seq_length(self) -> int:
        """Tokens seen (not kept), so position ids keep counting after eviction (DESIGN.md §2, Positions)."""
        return self.seen_tokens

    def get_max_length(self) -> int:
        return -1

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held: stored buffers (data, scales, zeros; all slots), slot positions and scores, residual
        window and its scores."""
        held = [t for t in (self.residual_keys, self.residual_values, self.residual_scores) if t is not None]
        for store in (self.stored_keys, self.stored_values, self.slot_info):
            if store is not None:
                held += store.parts.values()
        return held

    def nbytes(self) -> int:
        """Bytes of every tensor held (:meth:`tensors`), free slots of the preallocated buffer included."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The layer's tokens as named tensors, held slots only (for saving): ``stored_keys.<part>``,
        ``stored_values.<part>``, ``slot_info.<part>``, ``residual_keys``, ``residual_values``,
        ``residual_scores``, ``leading_pads``."""
        state = {}
        for name in ("stored_keys", "stored_values", "slot_info"):
            store = getattr(self, name)
            if store is not None:
                state |= {f"{name}.{part}": t for part, t in store.narrow(self.stored_length).parts.items()}
        for name in ("residual_keys", "residual_values", "residual_scores", "leading_pads"):
            if getattr(self, name) is not None:
                state[name] = getattr(self, name)
        return state

    def load_state_tensors(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`state_tensors` returned (on an initialised, empty layer), re-allocating the
        buffer to :meth:`target_slots`."""
        for name in ("stored_keys", "stored_values", "slot_info"):
            parts = {k[len(name) + 1 :]: t for k, t in state.items() if k.startswith(name + ".")}
            setattr(self, name, StoredTensor(parts) if parts else None)
        self.stored_length = 0 if self.stored_keys is None else len(self.stored_keys)
        if self.stored_keys is not None:
            slots = self.target_slots(self.stored_length)
            for name in ("stored_keys", "stored_values", "slot_info"):
                if getattr(self, name) is not None:
                    setattr(self, name, getattr(self, name).resized(self.stored_length, slots))
        for name in ("residual_keys", "residual_values", "residual_scores", "leading_pads"):
            setattr(self, name, state.get(name))

    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        for name in ("stored_keys", "stored_values", "slot_info"):
            stored = getattr(self, name)
            if stored is not None:
                setattr(self, name, stored.map_batch(fn))
        for name in ("residual_keys", "residual_values", "residual_scores"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, fn(tensor))
        held = self.stored_keys.parts if self.stored_keys is not None else {"r": self.residual_keys}
        tensor = next(iter(held.values()))
        if tensor is not None:
            self.batch = tensor.shape[0]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder sequences for beam search (tokens, scales and scores move together)."""
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def crop(self, tokens_to_remove: int) -> None:
        raise CacheStateError("a compressed cache cannot be cropped: evicted tokens cannot be restored")

    def offload(self):  # tensors live in custom containers; keep them where they are
        return None

    def prefetch(self):
        return None


class CompressedCache(Cache):
    """A transformers ``Cache`` that evicts and quantizes, one :class:`CompressedLayer` per model layer.

    Use with ``model.generate(..., past_key_values=cache)`` or a manual forward loop; build it with
    :func:`h2o_compress.make_cache`, which also switches the model to the ``h2o_compress`` attention
    function. ``get_seq_length()`` counts tokens seen; :meth:`kept_length` counts tokens held.
    """

    def __init__(self, layers: list[CompressedLayer], config: CompressionConfig, model_id: str = ""):
        super().__init__(layers=layers)
        self.config = config
        self.model_id = model_id

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Route to :meth:`CompressedLayer.update`, after checking that the layer exists and that the previous
        forward pass reached every layer.

        Raises:
            CacheStateError: ``layer_idx`` beyond this cache's layers (another model), or layers that hold
                different token counts (a forward pass failed half-way).
        """
        if not 0 <= layer_idx < len(self.layers):
            raise CacheStateError(
                f"layer_idx={layer_idx} but this cache has {len(self.layers)} layers: it was made for another model"
            )
        if layer_idx == 0:
            self.check_finite()
            seen = {layer.seen_tokens for layer in self.layers}
            if len(seen) > 1:
                raise CacheStateError(
                    f"the layers of this cache hold different token counts ({min(seen)} to {max(seen)}): an earlier "
                    "forward pass failed half-way; call cache.reset() or build a new cache"
                )
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def check_finite(self) -> None:
        """Raise if a CUDA decode step fed non-finite keys or values (checked here, once per step, instead of with a
        host sync in every layer; CPU and multi-token steps are checked at once).

        Raises:
            InputError: NaN or Inf reached the cache; it is poisoned, so call ``cache.reset()`` or build a new one.
        """
        flags = [layer.finite for layer in self.layers if layer.finite is not None]
        if not flags:
            return
        for layer in self.layers:
            layer.finite = None
        if not bool(torch.stack([flag.to(flags[0].device) for flag in flags]).all()):
            raise InputError(
                "keys or values of an earlier decode step were not finite (NaN or Inf); the cache holds them, so "
                "call cache.reset() or build a new cache, and check the inputs and the model weights"
            )

    @property
    def capacity(self) -> int | None:
        """Tokens kept per layer, sequence and KV head (``None``: unbounded)."""
        return self.layers[0].capacity

    def kept_length(self, layer_idx: int = 0) -> int:
        """Tokens held now by ``layer_idx``, per sequence and KV head."""
        return self.layers[layer_idx].kept_length()

    def nbytes(self) -> int:
        """Bytes of every tensor the cache holds (packed data, scales, zeros, residual window, scores)."""
        return sum(layer.nbytes() for layer in self.layers)

    def storage_nbytes(self) -> int:
        """Bytes of the storages behind every tensor held; above :meth:`nbytes` only if a view pins a larger
        buffer (a check that eviction really frees memory)."""
        return sum(t.untyped_storage().nbytes() for layer in self.layers for t in layer.tensors())

    def full_fp16_nbytes(self) -> int:
        """Bytes the uncompressed fp16 cache would hold for the tokens seen:
        ``2 x layers x kv_heads x head_dim x tokens x batch x 2``."""
        ready = [layer for layer in self.layers if layer.is_initialized]
        if not ready:
            return 0
        layer = ready[0]
        return 2 * len(self.layers) * layer.kv_heads * layer.head_dim * layer.seen_tokens * layer.batch * 2

    def save(self, path, model=None):
        """Write this cache to ``path`` (safetensors, atomic); see :func:`h2o_compress.persistence.save_cache`.

        Raises:
            CacheStateError: empty, mid-step or inconsistent cache, or no ``model`` and no recorded fingerprint.
            CacheFileError: bad path or missing directory.
        """
        from .persistence import save_cache

        return save_cache(self, path, model=model)

    @classmethod
    def load(cls, path, model, config=None) -> "CompressedCache":
        """Load a cache saved by :meth:`save` for ``model``; see :func:`h2o_compress.persistence.load_cache`.

        Raises:
            CacheFileError: missing, truncated, tampered or unknown-version file.
            CacheStateError: a different model or config than the one saved.
        """
        from .persistence import load_cache

        return load_cache(path, model, config=config)


def build_layers(
    config: CompressionConfig, num_layers: int, head_dim: int, capacity: int | None
) -> list[CompressedLayer]:
    """One :class:`CompressedLayer` per model layer for ``config`` (see :func:`h2o_compress.make_cache`)."""
    layers = []
    for idx in range(num_layers):
        policy = make_policy(config.policy, config.heavy_ratio, config.sink_tokens)
        layers.append(
            CompressedLayer(
                idx,
                policy,
                capacity,
                make_quantizer(config.key_bits, config.quant, config.group_size, head_dim, config.rotate),
                make_quantizer(config.value_bits, config.quant, config.group_size, head_dim, config.rotate),
                residual=config.residual,
                score_chunk_size=config.score_chunk_size,
                attention_kernel=config.attention_kernel,
            )
        )
    return layers

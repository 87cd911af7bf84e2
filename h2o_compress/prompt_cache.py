"""Prompt caches: bring a :class:`CompressedCache` up to a prompt, resuming from a saved or live one.

:func:`prefill` feeds only the prompt tokens a cache does not hold yet and records the prompt's token ids and
next-token logits on the cache (``cache.prompt_state``), so :func:`save_cache` stores them and a
loaded cache continues exactly like the live one. :func:`prepare_prompt_cache` is what
``h2o-compress generate --save-cache F / --load-cache F`` runs before generating.
"""

from __future__ import annotations

import torch

from .errors import CacheStateError, ConfigError, InputError, short
from .persistence import PromptState, check_save_target, load_cache, model_fingerprint, save_cache
from .weights import input_device


def check_context(model, prompt_tokens: int, max_new_tokens: int) -> None:
    """Raise InputError when ``prompt_tokens + max_new_tokens`` exceeds the model's ``max_position_embeddings``."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and prompt_tokens > limit:
        raise InputError(f"prompt of {prompt_tokens} tokens exceeds the model's context of {limit} tokens; allowed: a "
                         "shorter text")
    if limit and prompt_tokens + max_new_tokens > limit:
        raise InputError(
            f"prompt of {prompt_tokens} tokens + max_new_tokens={max_new_tokens} exceeds the model's context of "
            f"{limit} tokens; allowed: max_new_tokens at most {limit - prompt_tokens}, or a shorter prompt"
        )


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, cache) -> torch.Tensor:
    """Feed the tokens of ``input_ids`` that ``cache`` does not hold yet; return the next-token logits.

    A fresh cache gets the whole prompt in one forward pass (exactly what :func:`h2o_compress.generate` does,
    ``logits_to_keep=1``).
    A cache that already holds ``n`` tokens (loaded, or from an earlier prefill) must hold the first ``n``
    tokens of ``input_ids``; only ``input_ids[:, n:]`` is fed. When it holds the whole prompt, the recorded
    next-token logits are returned without running the model.

    Args:
        model: the causal LM the cache belongs to.
        input_ids: int64 ``[batch, tokens]`` on the model's device.
        cache: a :class:`CompressedCache` (batch must match).

    Returns:
        Logits ``[batch, vocab]`` (model dtype) of the token after the prompt. Sets ``cache.prompt_state``.

    Raises:
        InputError: the prompt does not start with the tokens the cache holds.
        CacheStateError: the cache holds tokens whose ids were not recorded, or holds the whole prompt
            without its next-token logits.
    """
    held = int(cache.get_seq_length())
    state = getattr(cache, "prompt_state", None)
    if held:
        if not isinstance(state, PromptState) or state.token_ids.shape[1] != held:
            raise CacheStateError(
                f"the cache holds {held} tokens but not their ids, so the prompt cannot be checked against it; "
                "allowed: a fresh cache or one saved after prefill()"
            )
        cached = state.token_ids.to(input_ids.device)
        if input_ids.shape[0] != cached.shape[0] or input_ids.shape[1] < held or not torch.equal(
            input_ids[:, :held], cached
        ):
            raise InputError(
                f"the prompt ({input_ids.shape[1]} tokens) does not start with the {held} tokens the cache holds; "
                "allowed: a prompt that extends the cached one"
            )
    if input_ids.shape[1] > held:
        inputs = input_ids[:, held:]
        logits = model(input_ids=inputs, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    elif state.next_logits is not None:
        logits = state.next_logits
    else:
        raise CacheStateError(
            "the cache holds the whole prompt but not its next-token logits; allowed: a prompt with more tokens"
        )
    cache.prompt_state = PromptState(input_ids.detach().to("cpu", copy=True), logits.detach().clone())
    if getattr(cache, "model_fingerprint", None) is None:
        cache.model_fingerprint = model_fingerprint(model)
    return logits


def shared_prefix_length(tokenizer, prompt: str, chat: bool = True) -> int:
    """Tokens of ``prompt`` (as :func:`~h2o_compress.generation.encode_prompt` gives them) that a follow-up
    prompt extending its text will share.

    Without the chat template, every token. With it, the tokens before the template's closing part (end of the
    user turn, assistant header), found as the common prefix of the prompt's ids and the ids of two
    extensions of its text (so a last word that merges with following text is left out too).
    """
    from .generation import encode_prompt

    ids = encode_prompt(tokenizer, prompt, chat)[0]
    if not (chat and getattr(tokenizer, "chat_template", None)):
        return int(ids.shape[0])
    shared = int(ids.shape[0])
    for suffix in (" and", "\n\nQ"):
        other = encode_prompt(tokenizer, prompt + suffix, chat)[0]
        n = min(shared, other.shape[0])
        differs = (ids[:n] != other[:n]).nonzero()
        shared = int(differs[0, 0]) if differs.numel() else n
    return max(1, shared)


def _check_generates(cache, source) -> None:
    """Refuse a loaded cache whose setting cannot keep evicting while it generates (:func:`check_usable`): e.g. a
    compressed context saved by ``ask`` with KVzip's setting (no recent window), which only ``ask`` continues
    without eviction. Raises ConfigError naming the file."""
    from .config import check_usable

    try:
        check_usable(cache.config, cache.capacity)
    except ConfigError as exc:
        raise ConfigError(
            f"{short(str(source))} was saved with a setting that cannot keep generating with eviction: {exc}. A "
            "compressed context saved by 'h2o-compress ask --save-cache' is continued by 'ask --load-cache' "
            "(it evicts nothing more there)"
        ) from None


def prepare_prompt_cache(
    model, tokenizer, prompt: str, config, max_new_tokens: int, chat: bool = True, load=None, save=None,
    expect: dict | None = None, overwrite: bool = False,
):
    """Build (or load) the cache for ``prompt``, prefill it, and optionally save it.

    Args:
        model, tokenizer: the LM and its tokenizer.
        prompt: the prompt text (through the chat template when ``chat``).
        config: :class:`CompressionConfig` of a new cache (ignored with ``load``: the file's config applies).
        max_new_tokens: new tokens planned; with a fractional budget, capacity =
            ``ceil(budget x (prompt tokens + max_new_tokens))``.
        load: path of a saved cache to start from (its prompt must be a prefix of this prompt's tokens).
        save: path to write the cache to (atomic), holding the tokens a follow-up prompt will share
            (:func:`shared_prefix_length`: with the chat template, the context without the assistant header).
        expect: with ``load``, config fields that must match the file's (e.g. the CLI flags given).
        overwrite: let ``save`` replace a file that is not a cache file (see
            :func:`h2o_compress.persistence.check_save_target`).

    Returns:
        The prefilled :class:`CompressedCache` (``cache.prompt_state`` holds the prompt and next logits).

    Raises:
        InputError: empty prompt, prompt + new tokens beyond the model's context, or a prompt that does not
            extend the loaded one.
        CacheFileError, CacheStateError: see :func:`h2o_compress.persistence.load_cache` / ``save_cache``.
        ConfigError: a loaded cache whose setting leaves no recent window (:func:`~h2o_compress.config.check_usable`),
            e.g. one saved by ``ask``.
    """
    from .generation import encode_prompt, make_cache

    if save is not None:
        check_save_target(save, overwrite)
    device = input_device(model)
    input_ids = encode_prompt(tokenizer, prompt, chat).to(device)
    check_context(model, input_ids.shape[1], max_new_tokens)
    if load is not None:
        cache = load_cache(load, model, config=expect)
        _check_generates(cache, load)
    else:
        cache = make_cache(model, config, max_length=input_ids.shape[1] + max_new_tokens)
    if save is not None:
        shared = shared_prefix_length(tokenizer, prompt, chat)
        if shared > cache.get_seq_length():
            prefill(model, input_ids[:, :shared], cache)
        save_cache(cache, save, overwrite=overwrite)
    prefill(model, input_ids, cache)
    return cache

"""Prompt caches: bring a [`CompressedCache`][h2o_compress.cache.CompressedCache] up to a prompt, resuming from a saved or live one.

`prefill` feeds only the prompt tokens a cache does not hold yet and records the prompt's token ids and
next-token logits on the cache (``cache.prompt_state``), so [`save_cache`][h2o_compress.persistence.save_cache] stores them and a
loaded cache continues exactly like the live one. `prepare_prompt_cache` is what
``h2o-compress generate --save-cache F / --load-cache F`` runs before generating.
"""

from __future__ import annotations


from h2o_compress.utils.errors import ConfigError, short
from h2o_compress.config import check_usable
from h2o_compress.runtime.generation import encode_prompt, make_cache
from h2o_compress.runtime.prefill import check_context, context_window, extend_prompt
from h2o_compress.persistence import check_save_target, load_cache, save_cache
from h2o_compress.models.weights import input_device


def shared_prefix_length(tokenizer, prompt: str, chat: bool = True) -> int:
    """Tokens of ``prompt`` (as `encode_prompt` gives them) that a follow-up
    prompt extending its text will share.

    Without the chat template, every token. With it, the tokens before the template's closing part (end of the
    user turn, assistant header), found as the common prefix of the prompt's ids and the ids of two
    extensions of its text (so a last word that merges with following text is left out too).
    """
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
    """Refuse a loaded cache whose setting cannot keep evicting while it generates ([`check_usable`][h2o_compress.config.check_usable]): e.g. a
    compressed context saved by ``ask`` with KVzip's setting (no recent window), which only ``ask`` continues
    without eviction. Raises ConfigError naming the file."""
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
        model: the LM.
        tokenizer: its tokenizer.
        prompt: the prompt text (through the chat template when ``chat``).
        config: [`CompressionConfig`][h2o_compress.config.CompressionConfig] of a new cache (ignored with ``load``: the file's config applies).
        max_new_tokens: new tokens planned; with a fractional budget, capacity =
            ``ceil(budget x (prompt tokens + max_new_tokens))``.
        load: path of a saved cache to start from (its prompt must be a prefix of this prompt's tokens).
        save: path to write the cache to (atomic), holding the tokens a follow-up prompt will share
            (`shared_prefix_length`: with the chat template, the context without the assistant header).
        expect: with ``load``, config fields that must match the file's (e.g. the CLI flags given).
        overwrite: let ``save`` replace a file that is not a cache file (see
            [`h2o_compress.persistence.check_save_target`][h2o_compress.persistence.check_save_target]).

    Returns:
        The prefilled [`CompressedCache`][h2o_compress.cache.CompressedCache] (``cache.prompt_state`` holds the prompt and next logits).

    Raises:
        InputError: empty prompt, prompt + new tokens beyond the model's context, or a prompt that does not
            extend the loaded one.
        CacheFileError, CacheStateError: see [`h2o_compress.persistence.load_cache`][h2o_compress.persistence.load_cache] / ``save_cache``.
        ConfigError: a loaded cache whose setting leaves no recent window ([`check_usable`][h2o_compress.config.check_usable]),
            e.g. one saved by ``ask``.
    """
    if save is not None:
        check_save_target(save, overwrite)
    device = input_device(model)
    input_ids = encode_prompt(tokenizer, prompt, chat, context_window(model)).to(device)
    check_context(model, input_ids.shape[1], max_new_tokens)
    if load is not None:
        cache = load_cache(load, model, config=expect)
        _check_generates(cache, load)
    else:
        cache = make_cache(model, config, max_length=input_ids.shape[1] + max_new_tokens)
    if save is not None:
        shared = shared_prefix_length(tokenizer, prompt, chat)
        if shared > cache.get_seq_length():
            extend_prompt(model, input_ids[:, :shared], cache)  # made or loaded for this model
        save_cache(cache, save, overwrite=overwrite)
    extend_prompt(model, input_ids, cache)
    return cache

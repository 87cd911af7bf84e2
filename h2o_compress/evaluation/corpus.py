"""Texts the evaluations read: the shipped public-domain corpus, user text files, and the agreement prompts.

The default corpus is the first six stories of *The Adventures of Sherlock Holmes* (public domain; provenance
in ``h2o_compress/data/README.md``). It is also the tuning text: the only text on which any default, factor, policy
or threshold is chosen. Quality figures are reported on the reporting corpus (`REPORTING_TEXTS`), texts of
other kinds that nothing is ever tuned on.
"""

from __future__ import annotations

import json
import warnings
from functools import lru_cache
from importlib import resources
from pathlib import Path

import torch

from h2o_compress.utils.errors import InputError, short
from h2o_compress.utils.files import MAX_TEXT_BYTES, parse_json, read_text

CORPUS_FILE = "sherlock_holmes.txt"
PROMPTS_FILE = "prompts.json"
TUNING_TEXT = CORPUS_FILE  # the one text defaults, factors, policies and thresholds may be chosen on
# name -> file in h2o_compress/data/reporting/: each at least 50,000 SmolLM2 tokens, never used for tuning
REPORTING_TEXTS = {
    "python_reference": "python_reference.txt",  # technical prose: the Python 3.11 Language Reference (PSF)
    "persuasion": "persuasion.txt",  # fiction: Jane Austen, *Persuasion* (1818, public domain)
    "python_code": "python_stdlib_code.txt",  # source code: six CPython 3.11.7 standard-library modules (PSF)
    "german_jokes": "german_jokes.txt",  # non-English: German jokes and anecdotes, fortunes-de 0.35 (GPL-2+)
    "fortune_quotes": "fortune_quotes.txt",  # quotations and dialogue lines: BSD fortune-mod 1.99.1 (BSD)
    "pci_ids": "pci_ids.txt",  # lists and tables: the PCI ID list of hwdata 0.368 (GPL-2+ or BSD-3-Clause)
}


def _data_text(name: str) -> str:
    return resources.files("h2o_compress").joinpath("data", name).read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def default_corpus() -> str:
    """The shipped English corpus (about 274 KB of public-domain prose), as one string."""
    return _data_text(CORPUS_FILE)


@lru_cache(maxsize=len(REPORTING_TEXTS))
def reporting_text(name: str) -> str:
    """The reporting text ``name`` (a key of `REPORTING_TEXTS`), as one string.

    Reporting texts are for reporting quality figures on text nobody tuned on: never choose a default, factor,
    policy or threshold with them (the tuning text is `TUNING_TEXT`). Provenance and licences are in
    ``h2o_compress/data/README.md``.

    Raises:
        InputError: ``name`` is not a reporting text.
    """
    if name not in REPORTING_TEXTS:
        raise InputError(f"unknown reporting text {short(name)}; allowed: {', '.join(REPORTING_TEXTS)}")
    file = resources.files("h2o_compress").joinpath("data", "reporting", REPORTING_TEXTS[name])
    return file.read_text(encoding="utf-8")


def read_text_file(path: str | Path) -> str:
    """The UTF-8 text of ``path``.

    Raises:
        InputError: the file is missing, unreadable, not UTF-8, or holds only whitespace.
    """
    text = read_text(path, "text file", InputError, MAX_TEXT_BYTES)
    if not text.strip():
        raise InputError(f"text file {short(str(path))} is empty; allowed: a file with some text")
    return text


#: The shipped texts ``--text-file`` takes by name: the tuning text, then the reporting texts.
TEXT_NAMES = ("sherlock", *REPORTING_TEXTS)


#: The word that names every reporting text at once where a list of texts is taken (``--quality-texts reporting``).
REPORTING = "reporting"


def expand_text_names(values) -> tuple[str, ...]:
    """``values`` (text names or file paths) with `REPORTING` replaced by the names of the reporting texts,
    duplicates dropped (the first kept). Nothing is read: `load_text` checks each value."""
    names: list[str] = []
    for value in values:
        for name in (REPORTING_TEXTS if value == REPORTING else [value]):
            if name not in names:
                names.append(name)
    return tuple(names)


def text_role(name: str | None) -> str:
    """``name`` as a report shows it: ``sherlock (tuning)`` for the tuning text (``None`` included),
    ``persuasion (reporting)`` for a reporting text, a file path as given."""
    if name is None or name == "sherlock":
        return "sherlock (tuning)"
    return f"{name} (reporting)" if name in REPORTING_TEXTS else str(name)


class TextNameWarning(UserWarning):
    """A shipped text's name was given while a file of that name is in the current folder: the shipped text is read
    (`text_name_clash` says so)."""


def text_name_clash(text_file) -> str | None:
    """What to say when ``text_file`` names a shipped text (`TEXT_NAMES`) and a file of that name is in the current
    folder too: the shipped text is read, ``./NAME`` reads the file. ``None`` when there is no such clash."""
    if not isinstance(text_file, str) or text_file not in TEXT_NAMES or not Path(text_file).exists():
        return None
    return (f"text {text_file!r} is the shipped text of that name; the file {text_file!r} in the current folder is "
            f"not read (give ./{text_file} to read it)")


def load_text(text_file: str | Path | None = None) -> str:
    """The text of ``text_file``: a shipped text by name (`TEXT_NAMES`: ``sherlock``, the tuning text, or a
    reporting text; ``./NAME`` reads a file of that name instead: a file of a shipped text's name in the current
    folder gets a `TextNameWarning` saying which is read), a file path, or the shipped corpus (the tuning text) when
    ``None`` (see `read_text_file` for errors)."""
    clash = text_name_clash(text_file)
    if clash is not None:
        warnings.warn(clash, TextNameWarning, stacklevel=2)
    if text_file is None or text_file == "sherlock":
        return default_corpus()
    if isinstance(text_file, str) and text_file in REPORTING_TEXTS:
        return reporting_text(text_file)
    return read_text_file(text_file)


def tokenize_text(tokenizer, text: str, max_tokens: int | None = None) -> torch.Tensor:
    """Token ids ``[1, tokens]`` of ``text`` (no special tokens added), cut to ``max_tokens``.

    Only about ``8 x max_tokens`` characters are tokenized, so a long corpus is cheap to cut.

    Raises:
        InputError: the text gives fewer than 2 tokens (nothing to predict).
    """
    if max_tokens is not None:
        text = text[: max(64, 8 * max_tokens)]
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    if max_tokens is not None:
        ids = ids[:, :max_tokens]
    if ids.shape[1] < 2:
        raise InputError(f"the text gives {ids.shape[1]} token(s); allowed: a text of at least 2 tokens")
    return ids


def load_prompts(prompts_file: str | Path | None = None) -> list[str]:
    """Agreement prompts: the shipped list, or ``prompts_file`` (a JSON list of strings, or one prompt a line).

    Raises:
        InputError: unreadable file, malformed JSON list, or no non-empty prompt.
    """
    if prompts_file is None:
        prompts = json.loads(_data_text(PROMPTS_FILE))
    else:
        text = read_text_file(prompts_file)
        if text.lstrip().startswith("["):
            prompts = parse_json(text, f"prompts file {short(str(prompts_file))}", InputError)
            if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
                raise InputError(f"prompts file {short(str(prompts_file))} is not a list of strings; allowed: a JSON list of strings")
        else:
            prompts = text.splitlines()
    prompts = [p.strip() for p in prompts if p.strip()]
    if not prompts:
        raise InputError("no prompt found; allowed: a JSON list of strings or one prompt a line")
    return prompts

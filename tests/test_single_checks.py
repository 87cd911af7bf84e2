"""A request is checked and clamped in one place: a source scan of ``h2o_compress`` that fails when the capacity
clamp (``min(capacity, max_length)``) or a hand-written integer check (``isinstance(x, bool) or not isinstance(x,
int)``) comes back outside the one helper that holds it (`CompressionConfig.kept_tokens` / `clamp_capacity`,
`h2o_compress.utils.checks.check_count`)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from h2o_compress.config import CompressionConfig, clamp_capacity
from h2o_compress.utils.checks import check_count
from h2o_compress.utils.errors import ConfigError

PACKAGE = Path(__file__).resolve().parents[1] / "h2o_compress"

# storage capped at the tokens the cache can see (not a window's or the sinks' cap, nor the tokens kept of a run)
CLAMP = re.compile(r"min\(\s*cap\w*\s*,\s*(?:self\.)?(?:max_length|max_tokens|longest)\s*\)")
# any check that a value is not a bool (an int or number check, or a flag check) written by hand
INTEGER_CHECK = re.compile(r"isinstance\(([^,()]+), bool\)")

CLAMP_ALLOWED = {
    "config.py": 1,  # clamp_capacity itself
}
INTEGER_CHECK_ALLOWED = {
    "utils/checks.py": 3,  # is_integer, is_real and check_flag themselves
    "cli/reference.py": 1,  # how a flag's default is printed, not a check of a value given
}


def _counts(pattern: re.Pattern) -> Counter:
    counts = Counter()
    for path in sorted(PACKAGE.rglob("*.py")):
        found = len(pattern.findall(path.read_text(encoding="utf-8")))
        if found:
            counts[path.relative_to(PACKAGE).as_posix()] = found
    return counts


@pytest.mark.parametrize(("pattern", "allowed", "helper"), [
    (CLAMP, CLAMP_ALLOWED, "CompressionConfig.kept_tokens or clamp_capacity"),
    (INTEGER_CHECK, INTEGER_CHECK_ALLOWED, "h2o_compress.utils.checks (is_integer, is_real, check_flag, check_count)"),
])
def test_no_hand_written_copy_comes_back(pattern, allowed, helper):
    extra = {path: n for path, n in _counts(pattern).items() if n > allowed.get(path, 0)}
    assert not extra, f"use {helper} instead of writing the check again: {extra}"


def test_the_scan_sees_the_helpers():
    """The patterns match the helpers' own lines, so a scan that finds nothing is not a broken regex."""
    assert _counts(CLAMP)["config.py"] == 1
    assert _counts(INTEGER_CHECK)["utils/checks.py"] == 3


def test_kept_tokens_caps_the_capacity_at_the_length():
    assert CompressionConfig(budget=100).kept_tokens(30) == 30
    assert CompressionConfig(budget=10).kept_tokens(30) == 10
    assert CompressionConfig(budget=0.5, min_capacity=0).kept_tokens(30) == 15
    assert CompressionConfig(budget=100).kept_tokens(None) == 100  # length unknown: the budget in tokens
    assert CompressionConfig(policy="full").kept_tokens(30) is None
    assert clamp_capacity(None, 5) is None and clamp_capacity(7, None) == 7 and clamp_capacity(7, 5) == 5


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"value": True}, "n=True is invalid; allowed: an integer >= 1 (tokens), at most 2147483647"),
    ({"value": 0, "unit": ""}, "n=0 is invalid; allowed: an integer >= 1, at most 2147483647"),
    ({"value": -1, "minimum": 0, "maximum": None}, "n=-1 is invalid; allowed: an integer >= 0 (tokens)"),
    ({"value": 2.0, "allowed": "an integer from 1 to 3"}, "n=2.0 is invalid; allowed: an integer from 1 to 3"),
])
def test_check_count_messages(kwargs, message):
    with pytest.raises(ConfigError) as refused:
        check_count("n", **kwargs)
    assert str(refused.value) == message


def test_check_count_without_maximum_takes_any_size():
    assert check_count("n", 2**80, maximum=None) == 2**80


CHECK_FUNCTION = re.compile(r"^\s*def (check_\w+)\(", re.MULTILINE)
MOST_CHECK_FUNCTIONS = 50


def test_checks_are_few_and_none_is_skipped():
    """A value is checked once where it enters: few ``check_*`` functions in the package, and no flag that lets a
    caller skip a check made before (a request object is validated once, and the runtime trusts it)."""
    sources = {path.relative_to(PACKAGE).as_posix(): path.read_text(encoding="utf-8")
               for path in sorted(PACKAGE.rglob("*.py"))}
    names = [name for text in sources.values() for name in CHECK_FUNCTION.findall(text)]
    assert len(names) <= MOST_CHECK_FUNCTIONS, f"{len(names)} check_ functions: {sorted(names)}"
    skipping = [path for path, text in sources.items() if re.search(r"\w+_checked_for\b|skip_checks?\b", text)]
    assert not skipping, f"a flag that skips validation: {skipping}"

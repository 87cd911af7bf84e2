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
INTEGER_CHECK = re.compile(r"isinstance\(([\w.\[\]'\"]+), bool\)\s*or\s+not\s+isinstance\(\1, int\)")

CLAMP_ALLOWED = {
    "config.py": 1,  # clamp_capacity itself
}
INTEGER_CHECK_ALLOWED = {
    "utils/checks.py": 1,  # check_count itself
    # a different rule or message than check_count's: -1 allowed, a returned reason, ModelLoadError, set
    # membership ("is not supported"), a message without the value, a filter, a list's items
    "cache/container.py": 1,
    "jobs/batch_files.py": 1,
    "models/dims.py": 1,
    "models/weights.py": 3,
    "planner/sizes.py": 1,
    "planner/settings.py": 1,
    "runtime/generation.py": 1,
    # not yet moved to check_count (their modules were being edited elsewhere)
    "calibration/__init__.py": 1,
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
    (INTEGER_CHECK, INTEGER_CHECK_ALLOWED, "h2o_compress.utils.checks.check_count"),
])
def test_no_hand_written_copy_comes_back(pattern, allowed, helper):
    extra = {path: n for path, n in _counts(pattern).items() if n > allowed.get(path, 0)}
    assert not extra, f"use {helper} instead of writing the check again: {extra}"


def test_the_scan_sees_the_helpers():
    """The patterns match the helpers' own lines, so a scan that finds nothing is not a broken regex."""
    assert _counts(CLAMP)["config.py"] == 1
    assert _counts(INTEGER_CHECK)["utils/checks.py"] == 1


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

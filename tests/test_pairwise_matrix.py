"""The all-pairs matrix the decode-step tests run (tests/helpers/pairwise.py) meets every pair of values."""

from __future__ import annotations

import itertools

import pytest
from helpers.pairwise import all_pairs, decode_matrix


def unmet_pairs(cases: list[tuple], factors: list[list]) -> list:
    return [(i, a, j, b) for i, j in itertools.combinations(range(len(factors)), 2)
            for a in factors[i] for b in factors[j] if not any(c[i] == a and c[j] == b for c in cases)]


@pytest.mark.parametrize("sizes", [(2, 2), (2, 3, 4), (13, 3, 2, 3), (3, 13, 3), (1, 4, 2), (5, 5, 5, 5, 5)])
def test_every_pair_of_values_meets_and_the_first_two_factors_cross_whole(sizes):
    factors = [[f"{n}-{k}" for k in range(size)] for n, size in enumerate(sizes)]
    cases = all_pairs(**{f"f{n}": values for n, values in enumerate(factors)})
    assert unmet_pairs(cases, factors) == []
    assert len(set(cases)) == len(cases)
    assert len(cases) < len(list(itertools.product(*factors))) or len(sizes) == 2 or 1 in sizes
    assert {(c[0], c[1]) for c in cases} == set(itertools.product(factors[0], factors[1]))


def test_a_case_missing_from_the_matrix_is_noticed():
    factors = [["a", "b"], [1, 2], ["x", "y"]]
    cases = all_pairs(first=factors[0], second=factors[1], third=factors[2])
    assert unmet_pairs(cases[1:], factors) != []


def test_the_full_matrix_on_request(monkeypatch):
    monkeypatch.setenv("H2O_COMPRESS_FULL_MATRIX", "1")
    assert decode_matrix(a=[1, 2], b="xy", c=[0, 1, 2]) == list(itertools.product([1, 2], "xy", [0, 1, 2]))


def test_fewer_than_two_factors_or_an_empty_one_is_refused():
    with pytest.raises(ValueError, match="at least two factors"):
        all_pairs(only=[1, 2])
    with pytest.raises(ValueError, match="at least two factors"):
        all_pairs(a=[1], b=[])

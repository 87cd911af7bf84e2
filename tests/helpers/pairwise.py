"""All-pairs test matrices: a list of cases in which every pair of values of any two factors meets at least once.

The decode-step matrices (kernel x architecture x policy x bits) grew to hundreds of cases whose cost is mostly a
model build and a trace each. Faults there come from one factor or the meeting of two (a policy at 4 bits, a
kernel on GPT-NeoX's partial rotary), which an all-pairs matrix still meets, at a third of the cases or fewer."""

from __future__ import annotations

import itertools


def all_pairs(**factors) -> list[tuple]:
    """Cases covering every pair of values of every two factors, built greedily and deterministically.

    The first two factors are crossed whole (one case per pair of their values); each case's other factors take
    the value that meets the most pairs not yet met (ties: the earlier value). Cases are then added, each
    started from the first pair still missing, until none is.

    Args:
        **factors: factor name -> its values (each a non-empty sequence); at least two factors.

    Returns:
        The cases, each a tuple with one value per factor, in the order of ``factors``.

    Raises:
        ValueError: fewer than two factors, or a factor without values.
    """
    values = [list(v) for v in factors.values()]
    if len(values) < 2 or not all(values):
        raise ValueError(f"all_pairs needs at least two factors, each with values; got {factors!r}")
    pairs = list(itertools.combinations(range(len(values)), 2))
    missing = {(i, a, j, b) for i, j in pairs for a in range(len(values[i])) for b in range(len(values[j]))}
    starts = [{0: a, 1: b} for a in range(len(values[0])) for b in range(len(values[1]))]
    cases = []
    while missing:
        if starts:
            fixed = starts.pop(0)
        else:
            i, a, j, b = min(missing)
            fixed = {i: a, j: b}
        case = _complete(fixed, values, missing)
        missing -= {(i, case[i], j, case[j]) for i, j in pairs}
        cases.append(tuple(values[k][case[k]] for k in range(len(values))))
    return cases


def _complete(fixed: dict, values: list, missing: set) -> list[int]:
    """Value indices for every factor: ``fixed`` ones as given, each other (in order) the value that meets the most
    missing pairs with the factors set before it."""
    case: list = [fixed.get(k) for k in range(len(values))]
    for k in range(len(values)):
        if case[k] is None:
            case[k] = max(range(len(values[k])), key=lambda v: (
                sum((min(i, k), case[i] if i < k else v, max(i, k), v if i < k else case[i]) in missing
                    for i in range(len(values)) if i != k and case[i] is not None), -v))
    return case


def decode_matrix(**factors) -> list[tuple]:
    """The cases a decode-step test runs: `all_pairs` of ``factors``, or their whole cross product where the
    environment sets ``H2O_COMPRESS_FULL_MATRIX=1`` (before a release, or to chase a fault the pairs missed)."""
    import os

    if os.environ.get("H2O_COMPRESS_FULL_MATRIX") == "1":
        return list(itertools.product(*factors.values()))
    return all_pairs(**factors)

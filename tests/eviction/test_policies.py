"""Eviction policies against independent references on hand-made scores."""

from __future__ import annotations

import pytest
import torch

from h2o_compress.eviction import POLICIES, H2OPolicy, LocalPolicy, SinkPolicy, make_policy


def reference_h2o(scores: list[float], capacity: int, heavy: int) -> list[int]:
    """Plain-Python H2O (paper §4): newest capacity-heavy tokens, then the heaviest of the rest (older wins ties)."""
    length = len(scores)
    recent = list(range(length - (capacity - heavy), length))
    candidates = [i for i in range(length) if i not in recent]
    candidates.sort(key=lambda i: (-scores[i], i))
    return sorted(recent + candidates[:heavy])


def test_h2o_picks_exactly_the_hand_computed_tokens():
    scores = torch.tensor([[[5.0, 0.1, 3.0, 0.2, 3.0, 0.0, 9.0, 0.5, 0.4, 0.3]]])
    keep = H2OPolicy(heavy_ratio=0.5).keep_indices(scores, 10, 6)
    # recent window = tokens 7, 8, 9; heavy hitters = 6 (9.0), 0 (5.0), then 2 over 4 (tie at 3.0, older wins)
    assert keep.tolist() == [[[0, 2, 6, 7, 8, 9]]]


def test_h2o_matches_reference_per_sequence_and_head():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 6, (3, 4, 40), generator=generator).float()  # many ties
    policy = H2OPolicy(heavy_ratio=0.25)
    keep = policy.keep_indices(scores, 40, 16)
    assert keep.shape == (3, 4, 16)
    for b in range(3):
        for h in range(4):
            assert keep[b, h].tolist() == reference_h2o(scores[b, h].tolist(), 16, policy.heavy(16))


def test_h2o_never_keeps_padding_when_real_tokens_fit():
    scores = torch.tensor([[[float("-inf"), float("-inf"), 0.0, 0.0, 1.0, 0.5, 0.2, 0.1]]])
    keep = H2OPolicy(heavy_ratio=0.5).keep_indices(scores, 8, 6)
    assert keep.tolist() == [[[2, 3, 4, 5, 6, 7]]]


def test_h2o_sinks_are_always_kept():
    scores = torch.tensor([[[0.0, 0.0, 9.0, 8.0, 0.0, 0.0, 0.0, 0.0]]])
    policy = H2OPolicy(heavy_ratio=0.5, sink_tokens=2)
    assert policy.heavy(6) == 2 and policy.recent_window(6) == 2
    assert policy.keep_indices(scores, 8, 6).tolist() == [[[0, 1, 2, 3, 6, 7]]]


def test_local_and_sink_windows():
    assert LocalPolicy().keep_indices(None, 10, 4).tolist() == [[[6, 7, 8, 9]]]
    assert SinkPolicy().keep_indices(None, 10, 6).tolist() == [[[0, 1, 2, 3, 8, 9]]]
    assert SinkPolicy(sink_tokens=1).keep_indices(None, 10, 3).tolist() == [[[0, 8, 9]]]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_registry_builds_every_policy(name):
    policy = make_policy(name, heavy_ratio=0.5)
    assert isinstance(policy, POLICIES[name])
    assert policy.recent_window(10) <= 10


def test_h2o_mean_ranks_by_mean_attention_not_the_sum():
    """An old token with a large sum but a small mean loses to a young token with a smaller sum, larger mean."""
    from h2o_compress.eviction import H2OMeanPolicy

    seen = 10
    scores = torch.tensor([[[3.0, 0.5, 1.2, 0.1, 0.1, 0.1]]])  # tokens at positions 0, 6, 7, 4, 8, 9
    positions = torch.tensor([[[0, 6, 7, 4, 8, 9]]])
    summed = H2OPolicy(heavy_ratio=0.5).rank(scores, positions, seen)
    mean = H2OMeanPolicy(heavy_ratio=0.5).rank(scores, positions, seen)
    assert torch.equal(summed, scores)
    torch.testing.assert_close(mean, torch.tensor([[[0.3, 0.125, 0.4, 1 / 60, 0.05, 0.1]]]))
    assert mean[0, 0].argmax() == 2 and summed[0, 0].argmax() == 0

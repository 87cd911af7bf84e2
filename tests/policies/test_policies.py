"""Eviction policies against independent references on hand-made scores."""

from __future__ import annotations

import pytest
import torch

from h2o_compress.policies import POLICIES, H2OPolicy, LocalPolicy, SinkPolicy, make_policy


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
def test_make_policy_passes_its_settings_and_protected_tokens_fit_the_capacity(name):
    """``make_policy`` hands ``heavy_ratio`` and ``sink_tokens`` to every policy (``local`` alone ignores sinks,
    by its definition), and at every capacity the protected tokens (sinks + recent window) fit in it: eviction
    keeps the top ``capacity`` by priority, so more protected tokens than that would evict a protected one. Every
    policy through a cache: tests/policies/test_policy_contract.py."""
    policy = make_policy(name, heavy_ratio=0.25, sink_tokens=3)
    assert policy.heavy_ratio == 0.25
    assert policy.sink_tokens == (0 if name == "local" else 3)
    assert make_policy(name).sink_tokens == POLICIES[name]().sink_tokens  # None: the policy's own default
    for capacity in range(0, 40):
        window = policy.recent_window(capacity)
        assert 0 <= window and window + min(policy.sink_tokens, capacity) <= capacity, capacity


def test_h2o_mean_ranks_by_mean_attention_not_the_sum():
    """An old token with a large sum but a small mean loses to a young token with a smaller sum, larger mean."""
    from h2o_compress.policies import H2OMeanPolicy

    seen = 10
    scores = torch.tensor([[[3.0, 0.5, 1.2, 0.1, 0.1, 0.1]]])  # tokens at positions 0, 6, 7, 4, 8, 9
    positions = torch.tensor([[[0, 6, 7, 4, 8, 9]]])
    summed = H2OPolicy(heavy_ratio=0.5).rank(scores, positions, seen)
    mean = H2OMeanPolicy(heavy_ratio=0.5).rank(scores, positions, seen)
    assert torch.equal(summed, scores)
    torch.testing.assert_close(mean, torch.tensor([[[0.3, 0.125, 0.4, 1 / 60, 0.05, 0.1]]]))
    assert mean[0, 0].argmax() == 2 and summed[0, 0].argmax() == 0


# -- tova, snapkv, strided -----------------------------------------------------------------------------------
def one_layer(policy: str, capacity: int, heads: int = 1, kv_heads: int = 1):
    from h2o_compress import CompressionConfig
    from h2o_compress.cache import build_layers

    config = CompressionConfig(policy=policy, budget=capacity, heavy_ratio=0.5, attention_kernel="torch")
    (layer,) = build_layers(config, 1, 32, capacity, max_tokens=64)
    return layer


MODULE = torch.nn.Module()


def step(layer, keys, query):
    """One step of a bare layer (update, then attention), as the attention function runs it."""
    returned, values = layer.update(keys, keys.clone())
    layer.attend(MODULE, query, returned, values, None, None)


def test_tova_ranks_by_the_current_query_only():
    """After a decode step, the scores are that step's attention (not a sum), so the token the current query
    ignores is evicted even if earlier queries attended it most."""
    from h2o_compress.policies import TOVAPolicy

    assert not TOVAPolicy.accumulates and TOVAPolicy.ranks_by == "scores"
    layer = one_layer("tova", 4)
    keys = torch.eye(32)[:6].view(1, 1, 6, 32) * 4  # token i along axis i
    query = torch.zeros(1, 1, 6, 32)
    query[..., 0], query[..., 1] = 4.0, 2.0  # every prompt query attends token 0 most, then token 1
    step(layer, keys, query)
    assert layer.positions()[0, 0].tolist() == [0, 1, 4, 5]  # heavy 0, 1 by the last query; recent 4, 5
    new = torch.zeros(1, 1, 1, 32)
    new[..., 6] = 4
    late = torch.zeros(1, 1, 1, 32)
    late[..., 1], late[..., 4] = 8.0, 1.0  # the current query attends token 1, then 4; token 0 least
    step(layer, new, late)
    assert layer.positions()[0, 0].tolist() == [1, 4, 5, 6]  # token 0 goes, though the prompt attended it most


def test_snapkv_votes_with_the_last_window_queries_and_pools_neighbours():
    from h2o_compress.policies import SnapKVPolicy

    policy = SnapKVPolicy(window=2, pool=3)
    keys = torch.eye(32)[:10].view(1, 1, 10, 32) * 6
    query = torch.zeros(1, 1, 10, 32)
    query[0, 0, :8, 1] = 6.0  # early queries attend token 1: they do not vote
    query[0, 0, 8:, 5] = 6.0  # the observation window attends token 5
    votes = policy.chunk_scores(query, keys, None, None, 64)
    assert votes[0, 0].argmax() in (4, 5, 6)
    assert torch.isclose(votes[0, 0, 4], votes[0, 0, 5]) and torch.isclose(votes[0, 0, 6], votes[0, 0, 5])
    assert votes[0, 0, 1] < votes[0, 0, 5] / 4  # token 1 got only the window's background attention
    unpooled = SnapKVPolicy(window=2, pool=1).chunk_scores(query, keys, None, None, 64)
    assert unpooled[0, 0].argmax() == 5 and unpooled[0, 0, 4] < unpooled[0, 0, 5] / 4


def test_strided_keeps_the_strided_positions_first():
    from h2o_compress.policies import StridedPolicy

    policy = StridedPolicy(heavy_ratio=0.5, stride=4)
    scores = torch.tensor([[[0.0, 9.0, 9.0, 9.0, 0.0, 9.0, 9.0, 9.0, 0.1, 0.0, 0.0, 0.0]]])
    keep = policy.keep_indices(scores, 12, 6)  # recent: 9, 10, 11; heavy share 3: positions 0, 4, 8
    assert keep.tolist() == [[[0, 4, 8, 9, 10, 11]]]
    # 2 strided slots: 8 (more attention), then 0 over 4 (a tie keeps the older)
    assert policy.keep_indices(scores, 12, 4).tolist() == [[[0, 8, 10, 11]]]


# -- a2sf ------------------------------------------------------------------------------------------------------------
def test_a2sf_weighs_a_chunks_queries_by_the_forgetting_factor():
    """Query i of n counts factor ** (n - 1 - i): against a plain softmax loop over hand-made queries."""
    from h2o_compress.policies import A2SFPolicy

    generator = torch.Generator().manual_seed(0)
    query, keys = torch.randn(1, 2, 5, 8, generator=generator), torch.randn(1, 1, 5, 8, generator=generator)
    expected = torch.zeros(5)
    for i in range(5):  # causal: query i sees keys 0..i; both query heads share the KV head
        probs = torch.softmax(query[0, :, i] @ keys[0, 0, : i + 1].T * 8**-0.5, dim=-1).sum(0)
        expected[: i + 1] += 0.5 ** (4 - i) * probs
    torch.testing.assert_close(A2SFPolicy(forgetting_factor=0.5).chunk_scores(query, keys, None, None, 2)[0, 0],
                               expected)
    torch.testing.assert_close(A2SFPolicy(forgetting_factor=1.0).chunk_scores(query, keys, None, None, 2),
                               H2OPolicy().chunk_scores(query, keys, None, None, 2))
    with pytest.raises(Exception, match=r"forgetting_factor=0 is out of range; allowed: a number in \(0, 1\]"):
        A2SFPolicy(forgetting_factor=0)


@pytest.mark.parametrize("kernel", ["torch", "auto"])
def test_a2sf_decode_scores_fade_then_add_the_steps_attention(kernel):
    """Every decode path (the torch form, the CPU kernel): after a step, a held token's score is factor x its score
    before + the step's attention (read off an ``h2o`` layer fed the same steps, whose scores only add)."""
    from h2o_compress import CompressionConfig
    from h2o_compress.cache import build_layers

    def layer(policy):
        config = CompressionConfig(policy=policy, budget=32, attention_kernel=kernel)
        (built,) = build_layers(config, 1, 32, 32, max_tokens=64)
        return built

    generator = torch.Generator().manual_seed(1)
    summed, faded = layer("h2o"), layer("a2sf")
    keys, query = torch.randn(1, 1, 6, 32, generator=generator), torch.randn(1, 1, 6, 32, generator=generator)
    step(summed, keys, query)
    step(faded, keys, query)

    def held(layer):  # scores by position: store and ring
        out = {}
        for positions, scores in ((layer.store.positions, layer.store.scores),
                                  (getattr(layer.ring, "positions", None), getattr(layer.ring, "scores", None))):
            if positions is not None:
                for p, s in zip(positions[0, 0].tolist(), scores[0, 0].tolist()):
                    if p >= 0:
                        out[p] = s
        return out

    for _ in range(4):
        before_sum, before_faded = held(summed), held(faded)
        new, q = torch.randn(1, 1, 1, 32, generator=generator), torch.randn(1, 1, 1, 32, generator=generator)
        step(summed, new, q)
        step(faded, new, q)
        after_sum, after_faded = held(summed), held(faded)
        for position, score in before_faded.items():
            expected = 0.8 * score + after_sum[position] - before_sum[position]
            assert after_faded[position] == pytest.approx(expected, rel=1e-5, abs=1e-6), position


def test_a2sf_factor_is_a_setting_of_its_own_policy_only(tmp_path):
    import json

    from helpers.tiny_lm import save_tiny_lm, tiny_lm
    from typer.testing import CliRunner

    from h2o_compress import CompressionConfig, ConfigError, make_cache
    from h2o_compress.cli import app

    model, _ = tiny_lm()
    cache = make_cache(model, CompressionConfig(policy="a2sf", budget=0.5, forgetting_factor=0.5), max_length=40)
    assert {layer.setting.policy.score_decay for layer in cache.layers} == {0.5}
    assert make_cache(model, CompressionConfig(policy="a2sf", budget=0.5), max_length=40).layers[0].setting.policy.score_decay == 0.8
    with pytest.raises(ConfigError, match=r"forgetting_factor=1.5 is out of range; allowed: a number in \(0, 1\]"):
        CompressionConfig(policy="a2sf", budget=0.5, forgetting_factor=1.5)
    with pytest.raises(ConfigError, match="forgetting_factor is set but policy='h2o'; allowed: forgetting_factor with"):
        CompressionConfig(policy="h2o", budget=0.5, forgetting_factor=0.5)
    model_dir = save_tiny_lm(tmp_path / "model")
    result = CliRunner().invoke(app, ["eval", "perplexity", "--model", model_dir, "--policy", "a2sf", "--budget", "0.25",
                                      "--forgetting-factor", "0.6", "--max-tokens", "40", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["config"]["forgetting_factor"] == 0.6


@pytest.mark.parametrize(("bits", "rotate"), [(16, False), (4, False), (4, True)])
def test_vatp_weighs_attention_by_the_value_norm(bits, rotate):
    """The most attended token has a near-zero value: h2o keeps it, vatp keeps the next two instead (prefill),
    and at a decode step vatp evicts the low-norm token first."""
    from h2o_compress import CompressionConfig
    from h2o_compress.cache import build_layers
    from h2o_compress.policies import VATPPolicy

    assert VATPPolicy.weighs_values and VATPPolicy.ranks_by == "scores" and POLICIES["vatp"] is VATPPolicy
    keys = torch.eye(32)[:6].view(1, 1, 6, 32) * 4  # token i along axis i
    values = torch.ones(1, 1, 6, 32)
    values[..., 0, :] = 0.01  # token 0: attended most, contributes almost nothing
    query = torch.zeros(1, 1, 6, 32)
    query[..., 0], query[..., 1], query[..., 2] = 4.0, 3.5, 3.0  # attention: token 0 > 1 > 2 > the rest
    kept = {}
    for policy in ("h2o", "vatp"):
        config = CompressionConfig(policy=policy, budget=4, heavy_ratio=0.5, kv_bits=bits, attention_kernel="torch",
                                   rotate=rotate)
        (layer,) = build_layers(config, 1, 32, 4, max_tokens=64)
        returned_keys, returned_values = layer.update(keys, values)
        layer.attend(MODULE, query, returned_keys, returned_values, None, None)
        layer.evict()
        kept[policy] = sorted(p for p in layer.positions()[0, 0].tolist() if p >= 0)
    assert kept["h2o"] == [0, 1, 4, 5]
    assert kept["vatp"] == [1, 2, 4, 5]

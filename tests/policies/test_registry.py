"""Adding a policy is one class and one registry line: the config, the CLI, the planner, the profile sweep's
settings and the report take it with no other edit, because each reads what the class declares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
from typer.testing import CliRunner

from h2o_compress import CompressionConfig, generate, plan
from h2o_compress.cli import app
from h2o_compress.cli.options import COMPRESSION_FLAGS
from h2o_compress.formats import FORMATS
from h2o_compress.policies import POLICIES, H2OPolicy, describe_policies, policy_names
from h2o_compress.profiling import ProfileSettings, run_profile
from h2o_compress.profiling.report import policy_color
from h2o_compress.utils.errors import ConfigError


@dataclass
class ThrowawayPolicy(H2OPolicy):
    """Heavy hitters ranked by their score squared (a test policy)."""

    summary: ClassVar[str] = "a throwaway ranking for the registry test"

    def rank(self, scores, positions, seen):
        return scores.float() ** 2


@pytest.fixture
def throwaway(monkeypatch):
    monkeypatch.setitem(POLICIES, "throwaway", ThrowawayPolicy)  # the one registry line
    return "throwaway"


def test_the_config_derives_what_a_policy_supports(throwaway):
    config = CompressionConfig(policy=throwaway, budget=0.5, kv_bits=4, head_budgets="adaptive")
    assert isinstance(config.eviction_policy(), ThrowawayPolicy)
    assert throwaway in policy_names(shares_heads=True) and throwaway not in policy_names(scorer=True)
    with pytest.raises(ConfigError, match="layer_budgets='global' with policy='throwaway'.*allowed policies: snapkv, kvzip, "
                                          "lookahead"):
        CompressionConfig(policy=throwaway, budget=0.5, layer_budgets="global")
    with pytest.raises(ConfigError, match="forgetting_factor is set but policy='throwaway'; allowed: forgetting_factor "
                                          "with policy 'a2sf' only"):
        CompressionConfig(policy=throwaway, forgetting_factor=0.5)
    assert "throwaway: a throwaway ranking for the registry test" in describe_policies()


def test_generate_runs_it_and_it_evicts(throwaway, tiny_model_dir):
    from h2o_compress import load_model

    model, tokenizer = load_model(tiny_model_dir)
    result = generate(model, tokenizer, "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16",
                      CompressionConfig(policy=throwaway, budget=8), max_new_tokens=4, chat=False)
    full = generate(model, tokenizer, "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16",
                    CompressionConfig(), max_new_tokens=4, chat=False)
    assert result.new_tokens == 4 and result.kv_bytes < full.kv_bytes


def test_the_cli_takes_it(throwaway, tiny_model_dir):
    out = CliRunner().invoke(app, ["generate", "--model", tiny_model_dir, "--policy", throwaway, "--budget", "8",
                                   "--max-new-tokens", "2", "--no-chat", "--json", "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10"])
    assert out.exit_code == 0, out.output
    assert '"new_tokens": 2' in out.output


def test_the_planner_and_the_profile_settings_take_it(throwaway):
    report = plan("llama-2-7b", "24GiB", policies=("h2o", throwaway), budgets=(0.2,), bits=(4,), group_sizes=(32,))
    assert {row.config.policy for row in report.rows} == {"h2o", throwaway}
    assert ProfileSettings(policies=(throwaway,), budgets=(0.2,), kv_bits=(4,)).configs()


def test_the_profile_sweep_and_its_report_take_it(throwaway, tiny_model_dir, tmp_path):
    from h2o_compress import load_model

    colours = [policy_color(name) for name in POLICIES]
    assert len(set(colours)) == len(colours)
    model, tokenizer = load_model(tiny_model_dir)
    settings = ProfileSettings(model="tiny", policies=("h2o", throwaway), budgets=(0.5,), kv_bits=(16,),
                               seq_lens=(16,), decode_tokens=2, ppl_tokens=24, chunk_size=8, agreement_prompts=1,
                               max_new_tokens=2)
    report = run_profile(settings, tmp_path / "out", show_progress=False, model=model, tokenizer=tokenizer)
    assert [r["label"] for r in report["results"]] == ["full unquantized", "h2o 0.5 unquantized", "throwaway 0.5 unquantized"]
    assert "| throwaway 0.5 unquantized |" in (tmp_path / "out" / "report.md").read_text()


def test_the_cli_help_and_defaults_come_from_the_declarations():
    help_text = COMPRESSION_FLAGS["policy"].option.help
    assert all(f"{name}: {cls.summary}" in help_text for name, cls in POLICIES.items())
    assert all(name in COMPRESSION_FLAGS["quant"].option.help for name in FORMATS)
    defaults = {f: flag.option.default for f, flag in COMPRESSION_FLAGS.items()}
    assert defaults["budget"] == str(CompressionConfig.budget) and defaults["kv_bits"] == CompressionConfig.kv_bits
    assert defaults["attention_kernel"] == CompressionConfig.attention_kernel


def test_a_format_declares_the_bits_it_stores():
    with pytest.raises(ConfigError, match="'int8-blockwise' is an 8-bit format, not 4-bit; allowed kv bits with it: "
                                          "8, 16"):
        CompressionConfig(quant="int8-blockwise", kv_bits=4)
    assert CompressionConfig(quant="int", kv_bits=4, high_bits_fraction=0.5).format.mixed_precision
    with pytest.raises(ConfigError, match="high_bits_fraction"):
        CompressionConfig(quant="nf4", kv_bits=4, high_bits_fraction=0.5)

"""A policy's own options are declared on its dataclass fields (``policy_option``): adding a policy with an option
is its class and one registry line, and the config, config files, saved settings, the planner and the CLI flag
(generated from the declaration) take the option with no other edit.

``PoweredPolicy`` below stands for a new policy's file. The CLI builds its flags when it is first imported, so the
test that drives the CLI registers the policy in a fresh interpreter before importing it (the way a plugin would
register its policy before the CLI runs).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from h2o_compress.config import CompressionConfig
from h2o_compress.policies import POLICIES, POLICY_OPTIONS, H2OPolicy, option_declarations, policy_names_taking
from h2o_compress.policies.base import policy_option
from h2o_compress.utils.errors import ConfigError, short

#: What the policy's ``rank`` saw, one entry per call (read by the CLI test's interpreter).
SEEN: list[float] = []


# -- the new policy's file --------------------------------------------------------------------------------------
@dataclass
class PoweredPolicy(H2OPolicy):
    """Heavy hitters ranked by their score raised to `exponent` (a test policy with an option of its own)."""

    summary: ClassVar[str] = "heavy hitters ranked by a power of their score (a test policy)"
    exponent: float = policy_option(2.0, help="the power of its score a token is ranked by.")

    def __post_init__(self) -> None:
        if isinstance(self.exponent, bool) or not isinstance(self.exponent, (int, float)) or not self.exponent > 0:
            raise ConfigError(f"exponent={short(self.exponent)} is invalid; allowed: a number > 0")

    def rank(self, scores, positions, seen):
        SEEN.append(self.exponent)
        return scores.float() ** self.exponent
# -----------------------------------------------------------------------------------------------------------------


def register(policies: dict) -> None:
    """The one registry line."""
    policies["powered"] = PoweredPolicy


@pytest.fixture
def powered(monkeypatch):
    monkeypatch.setitem(POLICIES, "powered", PoweredPolicy)
    return "powered"


def test_the_declared_option_is_derived_everywhere(powered):
    assert POLICY_OPTIONS["exponent"] == "exponent" and policy_names_taking("exponent") == ("powered",)
    declared = option_declarations()["exponent"]
    assert (declared.flag, declared.kind, declared.default) == ("--exponent", float, 2.0)
    assert POLICY_OPTIONS["lookahead_request"] == "request" and option_declarations()["lookahead_request"].flag == \
        "--lookahead-request"


def test_the_config_passes_it_to_the_policy_which_checks_it(powered):
    config = CompressionConfig(policy=powered, budget=8, policy_options={"exponent": 3.0})
    assert config.eviction_policy().exponent == 3.0
    assert config.to_dict()["policy_options"] == {"exponent": 3.0}
    assert CompressionConfig(**config.to_dict()) == config  # as a saved cache file reads it back
    assert CompressionConfig.from_values({"policy": powered, "budget": 8, "exponent": 3.0}) == config
    assert CompressionConfig(policy=powered).eviction_policy().exponent == 2.0
    with pytest.raises(ConfigError, match=r"^exponent=-1 is invalid; allowed: a number > 0$"):
        CompressionConfig(policy=powered, policy_options={"exponent": -1})
    with pytest.raises(ConfigError, match=r"^exponent is set but policy='h2o'; allowed: exponent with policy 'powered' "
                                          r"only$"):
        CompressionConfig(policy="h2o", policy_options={"exponent": 3.0})
    with pytest.raises(ConfigError, match="policy_options holds 'budget', a field of its own"):
        CompressionConfig(policy="a2sf", policy_options={"budget": 0.5})
    with pytest.raises(ConfigError, match="policy_options holds 'colour', an option no registered policy takes; "
                                          "allowed: evict_chat_header, forgetting_factor, lookahead_request, exponent$"):
        CompressionConfig(policy_options={"colour": 1})


def test_a_setting_without_one_reads_as_before(powered):
    assert "policy_options" not in CompressionConfig(policy="a2sf", forgetting_factor=0.5).to_dict()
    assert CompressionConfig(policy_options={"exponent": None}).to_dict() == CompressionConfig().to_dict()


def test_a_config_file_sets_it_by_its_name(powered, tmp_path):
    from h2o_compress.config_file import load_config

    path = tmp_path / "s.toml"
    path.write_text('policy = "powered"\nbudget = 8\nexponent = 1.5\n')
    assert load_config(path).eviction_policy().exponent == 1.5
    path.write_text('policy = "h2o"\nexponent = 1.5\n')
    with pytest.raises(ConfigError, match="exponent is set but policy='h2o'.*in config file"):
        load_config(path)


def test_the_planner_carries_it(powered, tiny_model_dir):
    from h2o_compress import choose_for_prompt, load_model

    model, tokenizer = load_model(tiny_model_dir)
    base = CompressionConfig(policy=powered, policy_options={"exponent": 3.0})
    row = choose_for_prompt(model, tokenizer, "w1 w2 w3 w4 w5 w6", "1GiB", max_new_tokens=2, chat=False, base=base,
                            budgets=(0.25,))  # evicting rows only
    assert (row.config.policy, row.config.policy_options) == (powered, {"exponent": 3.0})



def test_a_saved_cache_keeps_it(powered, tiny_model_dir, tmp_path):
    import torch

    from h2o_compress import load_cache, load_model, make_cache, save_cache
    from h2o_compress.utils.errors import CacheStateError

    model, _ = load_model(tiny_model_dir)
    cache = make_cache(model, CompressionConfig(policy=powered, budget=8, policy_options={"exponent": 3.0}))
    with torch.no_grad():
        model(input_ids=torch.arange(5, 17).unsqueeze(0), past_key_values=cache)
    path = save_cache(cache, tmp_path / "c.safetensors", model=model)
    loaded = load_cache(path, model, config={"exponent": 3.0})  # as --exponent 3 asks for it
    assert loaded.config.policy_options == {"exponent": 3.0}
    with pytest.raises(CacheStateError, match=r"exponent=2.5 \(file: 3.0\)"):
        load_cache(path, model, config={"exponent": 2.5})

CLI_RUN = """
import json, sys
sys.path.insert(0, sys.argv[1])
import test_policy_options as new_policy
from h2o_compress.policies import POLICIES
new_policy.register(POLICIES)
from typer.testing import CliRunner
from h2o_compress.cli import app
from h2o_compress.cli.options import COMPRESSION_FLAGS
words = "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12"
runs = {}
for name, flags in json.loads(sys.argv[3]).items():
    del new_policy.SEEN[:]
    out = CliRunner().invoke(app, ["generate", "--model", sys.argv[2], "--budget", "8", "--max-new-tokens", "2",
                                   "--no-chat", "--json", *flags, words])
    runs[name] = {"exit": out.exit_code, "output": out.output, "seen": sorted(set(new_policy.SEEN))}
runs["help"] = COMPRESSION_FLAGS["exponent"].option.help
print(json.dumps(runs))
"""


def test_the_cli_flag_is_generated_and_reaches_the_policy(tiny_model_dir):
    runs = {"given": ["--policy", "powered", "--exponent", "3"], "bad": ["--policy", "powered", "--exponent", "-1"],
            "other": ["--policy", "h2o", "--exponent", "3"], "default": ["--policy", "powered"]}
    done = subprocess.run([sys.executable, "-c", CLI_RUN, str(Path(__file__).parent), tiny_model_dir, json.dumps(runs)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["help"] == "With --policy powered: the power of its score a token is ranked by (default 2.0)."
    given = result["given"]
    assert given["exit"] == 0, given["output"]
    assert given["seen"] == [3.0]  # the flag's value reached the policy that ranked the prompt
    assert json.loads(given["output"])["config"]["policy_options"] == {"exponent": 3.0}
    assert result["default"]["exit"] == 0 and result["default"]["seen"] == [2.0]
    assert "policy_options" not in json.loads(result["default"]["output"])["config"]
    for name, message in (("bad", "error: exponent=-1.0 is invalid; allowed: a number > 0"),
                          ("other", "error: exponent is set but policy='h2o'; allowed: exponent with policy "
                                    "'powered' only")):
        assert result[name]["exit"] == 2 and result[name]["output"].strip() == message, result[name]

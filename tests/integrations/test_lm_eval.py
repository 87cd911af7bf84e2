"""The lm-evaluation-harness model type ``h2o-compress`` on a tiny LLaMA and the local task of
``tests/data/lm_eval_task`` (multiple choice, rolling loglikelihood, generation; no network).

(a) budget 1.0 and 16 bits give lm-eval's own ``hf`` scores and per-sample results; (b) budget 0.2 + 4 bits evicts
and moves them; (c) bad model_args give our one clear error, before anything is loaded.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_model_dir
from typer.testing import CliRunner

lm_eval = pytest.importorskip("lm_eval")  # in the `test` extra; the feature itself is the optional `lm-eval` extra

from lm_eval.tasks import TaskManager  # noqa: E402

from h2o_compress import ConfigError, load_model  # noqa: E402
from h2o_compress.cli import app  # noqa: E402
from h2o_compress.integrations.lm_eval_model import H2OCompressLM, check_model_args  # noqa: E402

TASK_DIR = Path(__file__).resolve().parents[1] / "data" / "lm_eval_task"
CHOICE, TEXT, ANSWER = "h2o_tiny_choice", "h2o_tiny_text", "h2o_tiny_answer"
TASKS = [CHOICE, TEXT, ANSWER]
LIMIT = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-lm-eval"))


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """The committed task YAMLs with their data_files made absolute (they are relative to the repository root)."""
    target = tmp_path_factory.mktemp("lm-eval-tasks")
    for yaml in TASK_DIR.glob("*.yaml"):
        text = yaml.read_text().replace("tests/data/lm_eval_task/", f"{TASK_DIR}/")
        (target / yaml.name).write_text(text)
    return str(target)


@pytest.fixture(scope="module")
def manager(task_dir):
    return TaskManager(include_path=task_dir, include_defaults=False)  # lm-eval's own ~10k tasks: 15 s to index


def evaluate(manager, model: str, model_args: str) -> dict:
    return lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=TASKS, task_manager=manager, limit=LIMIT, log_samples=True,
        bootstrap_iters=0,
    )


@pytest.fixture(scope="module")
def hf_results(manager, model_dir):
    return evaluate(manager, "hf", f"pretrained={model_dir},device=cpu")


@pytest.fixture(scope="module")
def full_results(manager, model_dir):
    return evaluate(manager, "h2o-compress", f"pretrained={model_dir},device=cpu,budget=1.0,kv_bits=16")


@pytest.fixture(scope="module")
def compressed_results(manager, model_dir):
    return evaluate(manager, "h2o-compress", f"pretrained={model_dir},device=cpu,budget=0.2,kv_bits=4")


def responses(results: dict, task: str) -> list:
    return [sample["resps"][i][0] for sample in results["samples"][task] for i in range(len(sample["resps"]))]


def test_budget_1_and_16_bits_give_the_hf_scores(hf_results, full_results):
    ours, theirs = full_results["results"], hf_results["results"]
    for metric in ("acc,none", "acc_norm,none"):
        assert ours[CHOICE][metric] == theirs[CHOICE][metric]
    assert ours[ANSWER]["exact_match,none"] == theirs[ANSWER]["exact_match,none"]
    assert responses(full_results, ANSWER) == responses(hf_results, ANSWER)  # the same greedy text
    for (ll, greedy), (ll_hf, greedy_hf) in zip(responses(full_results, CHOICE), responses(hf_results, CHOICE), strict=True):
        assert greedy == greedy_hf
        assert ll == pytest.approx(ll_hf, abs=1e-4)  # two passes (context, continuation) vs one: reassociation only
    rolling = responses(full_results, TEXT)
    assert len(rolling) == LIMIT
    assert rolling == pytest.approx(responses(hf_results, TEXT), rel=1e-6, abs=2e-3)  # ~130 tokens each, one at a time
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours[TEXT][metric] == pytest.approx(theirs[TEXT][metric], rel=1e-5)


def test_budget_0_2_and_4_bits_evict_and_move_the_scores(full_results, compressed_results, model_dir):
    lls = [ll for ll, _ in responses(compressed_results, CHOICE)]
    lls_full = [ll for ll, _ in responses(full_results, CHOICE)]
    assert all(math.isfinite(ll) for ll in lls)
    assert max(abs(a - b) for a, b in zip(lls, lls_full, strict=True)) > 0.05
    ours, full = compressed_results["results"][TEXT], full_results["results"][TEXT]
    assert abs(ours["word_perplexity,none"] - full["word_perplexity,none"]) > 1e-3 * full["word_perplexity,none"]
    assert responses(compressed_results, ANSWER) != responses(full_results, ANSWER)  # greedy text moves too
    assert compressed_results["config"]["compression"]["budget"] == 0.2


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_model(model_dir, device="cpu")


def test_the_context_is_compressed_before_the_continuation_is_scored(loaded):
    """Eviction happens at the end of the context's prefill (budget relative to the context), the continuation is
    scored on a frozen copy (the compressed context is unchanged, so every choice sees the same one), and grouping
    requests by context changes nothing."""
    model, tokenizer = loaded
    lm = H2OCompressLM(pretrained=model, tokenizer=tokenizer, budget=0.2, kv_bits=4)
    context = [(7 * i) % 120 for i in range(100)]
    cache, logits = lm._compressed_context(context)
    assert cache.kept_length() == 20 < len(context)
    before = {name: t.clone() for name, t in cache.layers[0].tensors().items()}
    first = lm._score_continuation(cache, logits, len(context), [5, 6, 7])
    assert {name: t for name, t in cache.layers[0].tensors().items()}.keys() == before.keys()
    assert all((cache.layers[0].tensors()[name] == t).all() for name, t in before.items())
    assert lm._score_continuation(cache, logits, len(context), [5, 6, 7]) == first
    requests = [(None, context, [5, 6, 7]), (None, context, [9]), (None, context[:50], [5, 6, 7])]
    together = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    alone = [lm._loglikelihood_tokens([request], disable_tqdm=True)[0] for request in requests]
    assert together == alone
    assert together[0] == first
    full = H2OCompressLM(pretrained=model, tokenizer=tokenizer)._loglikelihood_tokens(requests[:1], disable_tqdm=True)
    assert abs(full[0][0] - first[0]) > 1e-3


def test_a_scored_policy_scores_and_sizes_the_context_as_ask_does(loaded):
    """lm-eval's contexts go through the same scored cache as ``compress``: kvzip's reconstruction scores, and with
    ``layer_budgets=global`` the layers sized by them under the uniform total."""
    from h2o_compress.runtime.context_scores import global_layer_capacities, score_context

    model, tokenizer = loaded
    lm = H2OCompressLM(pretrained=model, tokenizer=tokenizer, policy="kvzip", budget=0.2, kv_bits=4,
                       layer_budgets="global")
    context = [(7 * i) % 120 for i in range(100)]
    cache, _ = lm._compressed_context(context)
    ids = torch.tensor([context])
    scores = score_context(model, tokenizer, ids, cache.layers[0].setting.policy)
    assert cache.capacities == global_layer_capacities(scores, 20, lm.compression.min_layer_capacity(20), 100)
    assert sum(cache.capacities) == 20 * len(cache.layers) and len(set(cache.capacities)) > 1  # not uniform


@pytest.mark.parametrize(
    "args,message",
    [
        ({"budget": 1.5}, "budget=1.5 is invalid"),
        ({"budget": 0}, "budget=0 is invalid"),
        ({"kv_bits": 5}, "kv_bits=5 is not supported; allowed: 4, 8, 16"),
        ({"policy": "nope"}, "unknown policy 'nope'"),
        ({"heavy_ratio": 1.0, "budget": 0.2}, "heavy_ratio=1.0 leaves no recent window"),
        ({"budgett": 0.2}, "unknown model_args 'budgett' for model type 'h2o-compress'"),
        ({"parallelize": True}, "unknown model_args 'parallelize'"),
        ({"batch_size": 8}, "batch_size=8 is not supported"),
        ({"batch_size": "auto"}, "batch_size='auto' is not supported"),
        ({"chunk_size": 0}, "chunk_size=0 is invalid"),
        ({"weights_bits": 3}, "weights_bits=3 is not supported; allowed: 16, 8, 4 or None"),
    ],
)
def test_bad_model_args_give_our_error_before_loading(manager, args, message):
    model_args = {"pretrained": "/no/such/model/dir", **args}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_model_args(model_args)
    with pytest.raises(ConfigError, match="^" + message.split(" ")[0].replace("(", r"\(")):
        lm_eval.simple_evaluate(model="h2o-compress", model_args=model_args, tasks=[CHOICE], task_manager=manager)


def test_weights_bits_reach_load_model(model_dir):
    """``weights_bits`` is a model_arg passed to ``load_model``: 8 packs a CPU model's Linear layers to int8; the
    default (None) leaves a model directory's in fp32, as ``load_model`` does."""
    packed = H2OCompressLM(pretrained=model_dir, device="cpu", weights_bits=8)
    assert any(type(m).__name__ == "Int8Linear" for m in packed.model.modules())
    default = H2OCompressLM(pretrained=model_dir, device="cpu")
    assert not any(type(m).__name__ == "Int8Linear" for m in default.model.modules())


def test_a_loaded_model_needs_its_tokenizer(loaded):
    with pytest.raises(ConfigError, match="needs its tokenizer"):
        H2OCompressLM(pretrained=loaded[0])


runner = CliRunner()


@pytest.fixture
def local_tasks_only(monkeypatch):
    """The CLI's TaskManager without lm-eval's own tasks (indexing them takes 15 s); ``--include-path`` still counts."""
    import lm_eval.tasks

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda include_path=None: TaskManager(
        include_path=include_path, include_defaults=False))


def test_cli_prints_a_table_and_writes_new_json(model_dir, task_dir, tmp_path, local_tasks_only):
    out = tmp_path / "scores.json"
    args = ["eval", "lm-eval", "--model-args", f"pretrained={model_dir},budget=0.2,kv_bits=4", "--tasks", CHOICE,
            "--limit", "2", "--include-path", task_dir, "--output", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "acc_norm" in result.output and CHOICE in result.output
    saved = json.loads(out.read_text())
    assert saved["results"][CHOICE]["sample_len"] == 2
    again = runner.invoke(app, args)  # nothing the user has is overwritten
    assert again.exit_code == 2 and "exists" in again.output
    assert json.loads(out.read_text()) == saved


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--model-args", "pretrained=x,kv_bits=3", "--tasks", CHOICE], "kv_bits=3 is not supported"),
        (["--model-args", "pretrained=x,foo=1", "--tasks", CHOICE], "unknown model_args 'foo'"),
        (["--tasks", " , "], "names no task"),
        (["--tasks", CHOICE, "--limit", "0"], "limit=0 is invalid"),
        (["--tasks", CHOICE, "--include-path", "/no/such/dir"], "is not a directory"),
        (["--tasks", "no_such_task_17"], "unknown lm-eval task(s) 'no_such_task_17'"),
    ],
)
def test_cli_refuses_bad_options_with_one_line(extra, message, local_tasks_only):
    result = runner.invoke(app, ["eval", "lm-eval", *extra])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_cli_task_data_out_of_reach_is_one_line(model_dir, task_dir, tmp_path, local_tasks_only, monkeypatch):
    """A task whose data set is neither cached nor reachable (offline: datasets raises ConnectionError) used to end
    in a rich traceback; now one ``error:`` line naming the task, and no --output file."""
    import lm_eval

    def offline(**kwargs):
        raise ConnectionError(f"Couldn't reach 'EleutherAI/{CHOICE}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(lm_eval, "simple_evaluate", offline)
    out = tmp_path / "scores.json"
    result = runner.invoke(app, ["eval", "lm-eval", "--model-args", f"pretrained={model_dir}", "--tasks", CHOICE,
                                 "--include-path", task_dir, "--output", str(out)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"lm-eval could not read the data of task(s) {CHOICE}: Couldn't reach" in result.output
    assert not out.exists()

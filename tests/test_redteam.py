"""Red team: hostile and absurd input thrown at the command line and at the Python API.

Every CLI case must end with exactly one ``error: ...`` line on stderr, exit code 2, no traceback, no file created
or changed in its working directory (a user's file it was pointed at included), nothing read from stdin, and within
its timeout (no hang). Every API case must raise an :class:`H2OCompressError`. The cases are the classes of issue 15
(docs/errors.md lists each with its message) and variations of them. Model-free where possible; the model cases use
a tiny random LLaMA saved to a temporary directory. Cases that check one value (no file, stdin or process effect)
run in-process through typer's CliRunner; the others run as subprocesses, three at a time, so the module stays
within about two minutes on two cores.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
from conftest import save_tiny_model_dir

from h2o_compress.persistence import load_cache
from h2o_compress import H2OCompressError

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 90


@dataclass
class Case:
    """One CLI run: ``args`` (``{dir}``: the case's own directory, ``{models}``: the shared model variants),
    ``setup(case_dir)`` to create its files first, extra ``env``, and a fragment the error line must hold."""

    id: str
    args: list[str]
    expect: str
    setup: Callable[[Path], None] | None = None
    env: dict = field(default_factory=dict)
    file_size_limit: int | None = None  # bytes a file may grow to (as ``ulimit -f``)
    in_process: bool = False  # a value check (no file, stdin or process effect): run through typer's CliRunner


# -- files the cases point at ---------------------------------------------------------------------------------------
def victim(case_dir: Path) -> None:
    """A user's text file (mode 0644) that must survive every case."""
    path = case_dir / "notes.txt"
    path.write_text("my notes\n")
    path.chmod(0o644)


def fifo(name: str):
    def make(case_dir: Path) -> None:
        os.mkfifo(case_dir / name)
    return make


def text(name: str, content: str):
    def make(case_dir: Path) -> None:
        (case_dir / name).write_text(content)
    return make


def binary(name: str, content: bytes):
    def make(case_dir: Path) -> None:
        (case_dir / name).write_bytes(content)
    return make


def subdir(case_dir: Path) -> None:
    (case_dir / "a_dir.safetensors").mkdir()


def both(*setups):
    def make(case_dir: Path) -> None:
        for setup in setups:
            setup(case_dir)
    return make


NESTED_JSON = "[" * 100_000 + "]" * 100_000
NESTED_TOML = "a = " + "[" * 100_000 + "]" * 100_000
HUGE_INT_JSON = '{"budget": ' + "9" * 5000 + "}"
INCOMPLETE_REPORT = json.dumps({"settings": {"model": "m"}, "results": [{"label": "x"}]})
ZERO_REF_REPORT = json.dumps({
    "settings": {"model": "m", "seq_lens": [8], "ppl_tokens": 8, "chunk_size": 1, "agreement_prompts": 0,
                 "max_new_tokens": 1, "decode_tokens": 1},
    "results": [{"label": "ref", "config": {"policy": "full", "kv_bits": 16, "budget": 1.0},
                 "perplexity": {"perplexity": 0.0, "kv_bytes": 1, "kv_bytes_full_fp16": 1, "capacity": None},
                 "speed": []}],
    "environment": {"device": "cpu", "device_name": "cpu", "packages": {}}, "created": "now",
})
NAN_PROFILE = json.dumps([{"config": {"policy": "h2o", "budget": 0.5, "kv_bits": 4}, "perplexity_ratio": 1.5}])

W = "w1 w2 w3 w4 w5 w6"
TINY = "{models}/tiny"
GEN = ["generate", "--no-chat", "--max-new-tokens", "2"]

CASES = [
    # -- compression settings and generation arguments (refused before the model loads) --------------------------
    Case("budget-inf", ["generate", "--budget", "inf", "hi"], "budget=inf is not finite"),
    Case("budget-1e400", ["generate", "--budget", "1e400", "hi"], "budget=1e400 is not finite", in_process=True),
    Case("budget-huge-int", ["generate", "--budget", "1000000000000", "hi"], "is too large", in_process=True),
    Case("budget-float-tokens", ["generate", "--budget", "1e3", "hi"],
         "budget=1e3 is invalid (tokens are written as an integer: 1000)", in_process=True),
    Case("budget-nan", ["generate", "--budget", "nan", "hi"], "not finite", in_process=True),
    Case("seed-2**70", ["generate", "--seed", str(2**70), "hi"], "seed="),
    Case("seed-negative", ["generate", "--seed", "-1", "hi"], "seed=-1 is invalid", in_process=True),
    Case("temperature-tiny", ["generate", "--temperature", "1e-45", "hi"],
         "temperature=1e-45 is invalid", in_process=True),
    Case("temperature-negative-no-save", ["generate", "--temperature", "-1", "--save-cache", "{dir}/new.safetensors",
                                          "hi"], "temperature=-1.0 is invalid"),
    Case("max-new-tokens-0-no-save", ["generate", "--max-new-tokens", "0", "--save-cache", "{dir}/notes.txt",
                                      "--overwrite", "hi"], "max_new_tokens=0 is invalid", victim),
    Case("sinks-fill-budget", ["generate", "--sink-tokens", "50", "--budget", "20", "hi"],
         "leaves no recent window", in_process=True),
    Case("heavy-ratio-1", ["generate", "--heavy-ratio", "1.0", "--budget", "0.2", "hi"],
         "leaves no recent window", in_process=True),
    Case("full-with-budget", ["generate", "--policy", "full", "--budget", "0.1", "hi"],
         "policy='full' keeps every", in_process=True),
    Case("residual-1e12", ["generate", "--residual", "1000000000000", "--kv-bits", "4", "hi"],
         "residual=", in_process=True),
    Case("threads-0", ["generate", "--threads", "0", "hi"], "threads=0 is invalid"),
    Case("prompt-lone-surrogate", ["generate", "w1 \udcff w2"], "not valid UTF-8"),
    Case("long-value-cut", ["generate", "--policy", "x" * 100_000, "hi"], "characters)", in_process=True),
    # -- files given as options ------------------------------------------------------------------------------------
    Case("save-over-text-file", [*GEN, "--model", TINY, "--save-cache", "{dir}/notes.txt", W],
         "is not an h2o-compress cache file", victim),
    Case("save-to-dev-null", ["generate", "--save-cache", "/dev/null", "hi"], "not a regular file"),
    Case("save-to-directory", ["generate", "--save-cache", "{dir}/a_dir.safetensors", "hi"], "a directory", subdir),
    Case("save-to-fifo", ["generate", "--save-cache", "{dir}/pipe", "hi"], "a FIFO", fifo("pipe")),
    Case("save-past-ulimit-f", [*GEN, "--model", TINY, "--save-cache", "{dir}/new.safetensors", W],
         "cannot write cache file", file_size_limit=4096),
    Case("save-missing-dir", ["generate", "--save-cache", "{dir}/no/such.safetensors", "hi"], "does not exist"),
    Case("load-dev-zero", ["generate", "--load-cache", "/dev/zero", "hi"], "not a regular file"),
    Case("load-fifo", ["generate", "--load-cache", "{dir}/pipe", "hi"], "not a regular file", fifo("pipe")),
    Case("config-fifo", ["generate", "--config", "{dir}/c.json", "hi"], "not a regular file", fifo("c.json")),
    Case("config-nested-json", ["generate", "--config", "{dir}/c.json", "hi"], "nested too deeply",
         text("c.json", NESTED_JSON)),
    Case("config-nested-toml", ["generate", "--config", "{dir}/c.toml", "hi"], "config file",
         text("c.toml", NESTED_TOML)),
    Case("config-huge-int", ["generate", "--config", "{dir}/c.json", "hi"], "config file", text("c.json", HUGE_INT_JSON)),
    Case("config-huge-int-toml", ["generate", "--config", "{dir}/c.toml", "hi"], "config file",
         text("c.toml", "budget = " + "9" * 5000), in_process=True),
    Case("config-not-utf8", ["generate", "--config", "{dir}/c.json", "hi"], "is not UTF-8", binary("c.json",
         b"{\xff}"), in_process=True),
    Case("config-a-list", ["generate", "--config", "{dir}/c.json", "hi"], "holds a list", text("c.json",
         "[1]"), in_process=True),
    Case("config-no-window", ["generate", "--config", "{dir}/c.json", "hi"], "leaves no recent window",
         text("c.json", '{"budget": 8, "sink_tokens": 8}'), in_process=True),
    # -- model directories -----------------------------------------------------------------------------------------
    Case("auto-map-config", [*GEN, "--model", "{models}/auto_map", W], "--trust-remote-code"),
    Case("auto-map-tokenizer", [*GEN, "--model", "{models}/auto_map_tokenizer", W], "tokenizer_config.json has an auto_map"),
    Case("plan-auto-map", ["plan", "--model", "{models}/auto_map", "--memory", "1GiB"], "--trust-remote-code"),
    Case("layers-1e9", [*GEN, "--model", "{models}/layers_1e9", W], "num_hidden_layers=1000000000 is out of range"),
    Case("plan-layers-1e9", ["plan", "--model", "{models}/layers_1e9", "--memory", "1GiB"], "num_hidden_layers="),
    Case("layers-negative", [*GEN, "--model", "{models}/layers_negative", W], "num_hidden_layers=-1", in_process=True),
    Case("plan-layers-negative", ["plan", "--model", "{models}/layers_negative", "--memory", "1GiB"],
         "num_hidden_layers=-1", in_process=True),
    Case("heads-0", [*GEN, "--model", "{models}/heads_0", W], "num_attention_heads=0", in_process=True),
    Case("layers-float", [*GEN, "--model", "{models}/layers_float", W], "num_hidden_layers=2.0", in_process=True),
    Case("config-json-list", [*GEN, "--model", "{models}/config_list", W], "holds a list", in_process=True),
    Case("weights-wrong-shape", [*GEN, "--model", "{models}/wrong_shape", W], "do not have the shapes"),
    Case("cache-env-is-a-file", ["generate", "hi"], "is not a directory", victim,
         env={"H2O_COMPRESS_CACHE": "{dir}/notes.txt"}),
    # -- planner -----------------------------------------------------------------------------------------------------
    Case("plan-huge-lengths", ["plan", "--model", "llama-2-7b", "--memory", "24GiB", "--residuals", "1000000000",
                               "--gen-len", "1000000000000"], "gen_len=1000000000000 is invalid"),
    Case("plan-huge-residual", ["plan", "--model", "llama-2-7b", "--memory", "24GiB", "--residuals", "1000000000"],
         "residual 1000000000 is invalid", in_process=True),
    Case("plan-group-0", ["plan", "--model", "llama-2-7b", "--memory", "24GiB", "--group-sizes", "0"],
         "group size 0", in_process=True),
    Case("plan-group-7", ["plan", "--model", "llama-2-7b", "--memory", "24GiB", "--group-sizes", "7"], "group size 7"),
    Case("plan-budgets-inf", ["plan", "--model", "llama-2-7b", "--memory", "24GiB", "--budgets", "inf"], "not finite"),
    Case("plan-budgets-1e400", ["plan", "--model", "llama-2-7b", "--memory", "24GiB", "--budgets", "0.5,1e400"],
         "not finite", in_process=True),
    Case("plan-memory-huge", ["plan", "--model", "llama-2-7b", "--memory", "9" * 400 + "GiB"],
         "memory", in_process=True),
    Case("plan-headroom", ["plan", "--model", "llama-2-7b", "--memory", "24GiB", "--headroom", "95%"],
         "headroom=", in_process=True),
    Case("plan-profile-nested", ["plan", "--model", "llama-2-7b", "--memory", "24GiB", "--profile", "{dir}/p.json"],
         "nested too deeply", text("p.json", NESTED_JSON)),
    Case("plan-batch-huge", ["plan", "--model", "llama-2-7b", "--memory", "24GiB", "--batch", str(2**40)],
         "batch=", in_process=True),
    # -- eval and profile --------------------------------------------------------------------------------------------
    Case("eval-text-dev-zero", ["eval", "perplexity", "--text-file", "/dev/zero"], "not a regular file"),
    Case("eval-text-fifo", ["eval", "perplexity", "--text-file", "{dir}/pipe"], "not a regular file", fifo("pipe")),
    Case("eval-prompts-nested", ["eval", "agreement", "--prompts-file", "{dir}/p.json"], "nested too deeply",
         text("p.json", NESTED_JSON)),
    Case("eval-text-not-utf8", ["eval", "perplexity", "--text-file", "{dir}/t.txt"], "is not UTF-8",
         binary("t.txt", b"caf\xe9 au lait"), in_process=True),
    Case("eval-prompts-not-utf8", ["eval", "agreement", "--prompts-file", "{dir}/p.txt"], "is not UTF-8",
         binary("p.txt", b"\xff\xfe"), in_process=True),
    Case("eval-threads-0", ["eval", "perplexity", "--threads", "0"], "threads=0", in_process=True),
    Case("eval-no-window", ["eval", "perplexity", "--sink-tokens", "50", "--budget", "20"],
         "no recent window", in_process=True),
    Case("eval-budget-inf", ["eval", "needle", "--budget", "inf"], "not finite", in_process=True),
    Case("profile-budgets-inf", ["profile", "--budgets", "1,inf", "--out", "{dir}/out"],
         "budgets='1,inf' is invalid", in_process=True),
    Case("profile-render-incomplete", ["profile", "--render", "{dir}/r.json", "--out", "{dir}/out"], "incomplete",
         text("r.json", INCOMPLETE_REPORT)),
    Case("profile-render-nested", ["profile", "--render", "{dir}/r.json", "--out", "{dir}/out"], "cannot read report",
         text("r.json", NESTED_JSON)),
    Case("profile-render-zero-reference", ["profile", "--render", "{dir}/r.json", "--out", "{dir}/out"],
         "reference perplexity is 0.0", text("r.json", ZERO_REF_REPORT), in_process=True),
]


# -- the shared model variants ----------------------------------------------------------------------------------------
EVIL_CODE = "import pathlib\npathlib.Path(__file__).with_name('RAN').write_text('ran')\n"


def _variant(models: Path, name: str, edit=None, file: str = "config.json") -> None:
    target = models / name
    shutil.copytree(models / "tiny", target)
    if edit is not None:
        path = target / file
        data = json.loads(path.read_text())
        result = edit(data)
        path.write_text(json.dumps(data if result is None else result))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """A tiny LLaMA directory and broken or hostile variants of it."""
    root = tmp_path_factory.mktemp("redteam-models")
    save_tiny_model_dir(root / "tiny")
    auto_map = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    _variant(root, "auto_map", lambda c: c.update(auto_map=auto_map))
    _variant(root, "auto_map_tokenizer", lambda c: c.update(auto_map={"AutoTokenizer": ["evil.T", None]}),
             file="tokenizer_config.json")
    for name in ("auto_map", "auto_map_tokenizer"):
        (root / name / "evil.py").write_text(EVIL_CODE)
    _variant(root, "layers_1e9", lambda c: c.update(num_hidden_layers=10**9))
    _variant(root, "layers_negative", lambda c: c.update(num_hidden_layers=-1))
    _variant(root, "heads_0", lambda c: c.update(num_attention_heads=0))
    _variant(root, "layers_float", lambda c: c.update(num_hidden_layers=2.0))
    _variant(root, "config_list", lambda c: [c])
    _variant(root, "wrong_shape", lambda c: c.update(intermediate_size=64))
    return root


def _snapshot(directory: Path) -> dict:
    """Every path under ``directory`` with its mode, and the SHA-256 of each regular file; except the compiled CPU
    kernel that any decoding run builds once under ``$H2O_COMPRESS_CACHE/kernels`` (a build artifact, not data)."""
    out = {}
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory).parts
        if relative[:2] == ("no-cache-here", "kernels") or relative == ("no-cache-here",):
            continue
        info = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if stat.S_ISREG(info.st_mode) else None
        out[str(path.relative_to(directory))] = (info.st_mode, digest)
    return out


LAUNCH = """
import resource, runpy, sys
limit = int(sys.argv[1])
if limit >= 0:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
sys.argv = ["h2o-compress", *sys.argv[2:]]
runpy.run_module("h2o_compress.cli", run_name="__main__")
"""


def _args(case: Case, case_dir: Path, models: Path) -> list[str]:
    fill = {"dir": str(case_dir), "models": str(models)}
    return [a.format(**fill) if "{" in a and "}" in a and len(a) < 1000 else a for a in case.args]


def _run_in_process(case: Case, case_dir: Path, models: Path) -> dict:
    from typer.testing import CliRunner

    from h2o_compress.cli import app

    if case.setup is not None:
        case.setup(case_dir)
    before = _snapshot(case_dir)
    env = {"H2O_COMPRESS_CACHE": str(case_dir / "no-cache-here"), "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    result = CliRunner().invoke(app, _args(case, case_dir, models), env=env, input="y\n")
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return {"hung": False, "rc": result.exit_code, "stderr": result.stderr, "stdout": result.stdout,
            "before": before, "after": _snapshot(case_dir)}


def _run(case: Case, case_dir: Path, models: Path) -> dict:
    if case.setup is not None:
        case.setup(case_dir)
    fill = {"dir": str(case_dir), "models": str(models)}
    args = _args(case, case_dir, models)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "H2O_COMPRESS_CACHE": str(case_dir / "no-cache-here") if "H2O_COMPRESS_CACHE" not in case.env else "",
           "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
    env.update({k: v.format(**fill) for k, v in case.env.items()})
    env["H2O_COMPRESS_CACHE"] = env["H2O_COMPRESS_CACHE"] or str(case_dir / "no-cache-here")
    before = _snapshot(case_dir)
    try:
        done = subprocess.run(
            [sys.executable, "-c", LAUNCH, str(case.file_size_limit or -1), *args], cwd=case_dir, env=env,
            input="y\ny\n",
            capture_output=True, text=True, timeout=TIMEOUT_S, errors="replace",
        )
    except subprocess.TimeoutExpired:
        return {"hung": True}
    return {"hung": False, "rc": done.returncode, "stderr": done.stderr, "stdout": done.stdout,
            "before": before, "after": _snapshot(case_dir)}


@pytest.fixture(scope="module")
def outcomes(models, tmp_path_factory, request) -> dict:
    """Run the selected CLI cases (three at a time); ``{case id: outcome}``."""
    selected = {item.callspec.params["case"].id for item in request.session.items
                if hasattr(item, "callspec") and isinstance(item.callspec.params.get("case"), Case)
                and not item.callspec.params["case"].in_process}
    root = tmp_path_factory.mktemp("redteam-cases")
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {}
        for case in CASES:
            if case.id in selected:
                (root / case.id).mkdir()
                futures[case.id] = pool.submit(_run, case, root / case.id, models)
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_cli_refuses_with_one_line_and_changes_nothing(case, outcomes, models, tmp_path):
    outcome = _run_in_process(case, tmp_path, models) if case.in_process else outcomes[case.id]
    assert not outcome["hung"], f"{case.id}: no answer within {TIMEOUT_S} s"
    lines = [line for line in outcome["stderr"].splitlines() if line.strip()]
    assert outcome["rc"] == 2, outcome["stderr"][-2000:]
    assert "Traceback" not in outcome["stderr"]
    assert len(lines) == 1 and lines[0].startswith("error: "), outcome["stderr"][-2000:]
    assert case.expect in lines[0], lines[0]
    assert len(lines[0]) < 2500, "long values must be cut"
    assert outcome["after"] == outcome["before"], "a file was created, changed or removed"
    assert not list(models.rglob("RAN")), "the model directory's code ran"


# -- the Python API ---------------------------------------------------------------------------------------------------
def _api_cases(tmp: Path, models: Path):
    import torch
    from conftest import tiny_llama

    from h2o_compress import CompressionConfig, generate, load_model, plan
    from h2o_compress.config import check_usable
    from h2o_compress.config_file import load_config
    from h2o_compress.utils.paths import check_cache_root
    from h2o_compress.persistence import check_save_target, read_cache_file
    from h2o_compress.planner import load_quality, parse_memory
    from h2o_compress.profiling.report import load_report, write_report

    class WordTokenizer:
        chat_template = None
        eos_token_id = None

        def __call__(self, text, return_tensors=None):
            return type("E", (), {"input_ids": torch.tensor([[1 + len(w) % 100 for w in text.split()]])})()

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    (tmp / "notes.txt").write_text("mine")
    os.mkfifo(tmp / "pipe")
    (tmp / "nested.json").write_text(NESTED_JSON)
    (tmp / "incomplete.json").write_text(INCOMPLETE_REPORT)
    model = tiny_llama()
    tok = WordTokenizer()
    return {
        "residual-1e12": lambda: CompressionConfig(residual=10**12),
        "no-recent-window": lambda: check_usable(CompressionConfig(budget=20, sink_tokens=50)),
        "heavy-ratio-1": lambda: check_usable(CompressionConfig(budget=0.2, heavy_ratio=1.0)),
        "full-with-budget": lambda: check_usable(CompressionConfig(policy="full", budget=0.1)),
        "auto-map": lambda: load_model(str(models / "auto_map"), device="cpu"),
        "trust-not-bool": lambda: load_model(str(models / "tiny"), device="cpu", trust_remote_code="yes"),
        "layers-1e9": lambda: load_model(str(models / "layers_1e9"), device="cpu"),
        "config-list": lambda: plan(str(models / "config_list"), "1GiB"),
        "plan-huge": lambda: plan("llama-2-7b", "24GiB", residuals=(10**9,), gen_len=10**12),
        "plan-group-7": lambda: plan("llama-2-7b", "24GiB", group_sizes=(7,)),
        "plan-headroom": lambda: plan("llama-2-7b", "24GiB", headroom="24GiB"),
        "memory-overflow": lambda: parse_memory("9" * 400 + "GiB"),
        "load-none-model": lambda: load_cache(str(tmp / "notes.txt"), None),
        "save-over-user-file": lambda: check_save_target(tmp / "notes.txt"),
        "save-to-fifo": lambda: check_save_target(tmp / "pipe", overwrite=True),
        "save-to-dir": lambda: check_save_target(tmp, overwrite=True),
        "read-dev-zero": lambda: read_cache_file("/dev/zero"),
        "nested-config": lambda: load_config(tmp / "nested.json"),
        "nested-profile": lambda: load_quality(tmp / "nested.json"),
        "incomplete-report": lambda: write_report(load_report(tmp / "incomplete.json"), tmp / "out"),
        "cache-root-file": lambda: check_cache_root(tmp / "notes.txt"),
        "temperature-tiny": lambda: generate(model, tok, "a bb", temperature=1e-45, chat=False),
        "seed-huge": lambda: generate(model, tok, "a bb", temperature=1.0, seed=2**70, chat=False),
        "prompt-surrogate": lambda: generate(model, tok, "a \udcff", chat=False),
        "max-new-tokens-huge": lambda: generate(model, tok, "a bb", max_new_tokens=2**40, chat=False),
    }


API_IDS = ["residual-1e12", "no-recent-window", "heavy-ratio-1", "full-with-budget", "auto-map", "trust-not-bool",
           "layers-1e9", "config-list", "plan-huge", "plan-group-7", "plan-headroom", "memory-overflow",
           "load-none-model", "save-over-user-file", "save-to-fifo", "save-to-dir", "read-dev-zero", "nested-config",
           "nested-profile", "incomplete-report", "cache-root-file", "temperature-tiny", "seed-huge",
           "prompt-surrogate", "max-new-tokens-huge"]


@pytest.fixture(scope="module")
def api_cases(models, tmp_path_factory):
    return _api_cases(tmp_path_factory.mktemp("redteam-api"), models)


@pytest.mark.parametrize("name", API_IDS)
def test_api_raises_our_error(name, api_cases):
    with pytest.raises(H2OCompressError) as excinfo:
        api_cases[name]()
    message = str(excinfo.value)
    assert "\n" not in message and len(message) < 2500, message


def test_every_api_case_is_run(api_cases):
    assert sorted(api_cases) == sorted(API_IDS)


# Under pytest -n 2 the whole file runs on one worker: the CLI cases run once, in the module fixture `outcomes`.
pytestmark = pytest.mark.xdist_group("redteam")

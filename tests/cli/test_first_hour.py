"""The first hour of a new user: documented options, the CLI package layout, threads, plots, settings that make no
sense together, the converted-model cache directory."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest
import typer
from typer.testing import CliRunner

from h2o_compress import CompressionConfig
from h2o_compress.cli import app
from h2o_compress.config import check_usable
from h2o_compress.utils.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
CLI = REPO / "h2o_compress" / "cli"


def _command(*path: str) -> click.Command:
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return command


def _long_options(command: click.Command) -> set[str]:
    return {o for p in command.params for o in p.opts + p.secondary_opts if o.startswith("--") and o != "--help"}


def test_every_generate_option_is_in_the_user_guide():
    guide = (REPO / "docs" / "guide" / "cli.md").read_text()  # the README's former "Command line" section
    section = guide[guide.index("## Options of `generate`"):]  # its tables
    documented = set(re.findall(r"--[a-z][a-z0-9-]*", section))
    missing = _long_options(_command("generate")) - documented
    assert not missing, f"options of generate missing from the user guide's option list: {sorted(missing)}"


@pytest.mark.parametrize("path", [("generate",), ("eval", "perplexity"), ("eval", "needle"), ("eval", "agreement"),
                                  ("profile",)])
def test_every_command_that_runs_a_model_takes_threads_and_trust_remote_code(path):
    options = _long_options(_command(*path))
    assert {"--threads", "--trust-remote-code", "--model", "--device", "--dtype"} <= options


def test_design_reference_is_in_the_repository_and_linked():
    assert (REPO / "docs" / "DESIGN.md").read_text().startswith("# h2o-compress: design and semantics")
    readme = (REPO / "README.md").read_text()
    assert "(docs/DESIGN.md)" in readme and not re.search(r"(?<![/\[])DESIGN\.md(?!\])", readme)
    semantics = (REPO / "docs" / "guide" / "semantics.md").read_text()  # the README's former "Semantics" section
    assert "(../DESIGN.md)" in semantics and "DESIGN.md" in (REPO / "mkdocs.yml").read_text()


# -- the CLI package ---------------------------------------------------------------------------------------------------
def test_compression_options_are_declared_once_in_a_leaf_module():
    # (``profile --kv-bits 16,8,4`` is a list for the sweep and ``plan --model`` takes known names: other options)
    for flag in ("--policy", "--budget", "--heavy-ratio", "--group-size", "--residual", "--kernel", "--quant",
                 "--sink-tokens", "--k-bits", "--threads", "--trust-remote-code", "--device"):
        declared = [p.name for p in CLI.glob("*.py") if f'"{flag}"' in p.read_text()]
        assert declared == ["options.py"], (flag, declared)
    imports = [n for n in ast.walk(ast.parse((CLI / "options.py").read_text())) if isinstance(n, ast.ImportFrom)]
    assert all(n.level != 1 for n in imports), "cli/options.py must not import other CLI modules"
    for path in (("generate",), ("eval", "perplexity"), ("eval", "needle"), ("eval", "agreement")):
        assert {"--policy", "--budget", "--kv-bits", "--kernel", "--residual"} <= _long_options(_command(*path))
    assert {"--heavy-ratio", "--quant", "--group-size", "--residual"} <= _long_options(_command("profile"))
    assert {"--quant", "--heavy-ratio", "--sink-tokens"} <= _long_options(_command("plan"))


def test_evaluation_does_not_import_the_cli():
    code = "import sys, h2o_compress.evaluation; print(any(m.startswith('h2o_compress.cli') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "False", out.stderr
    assert not (REPO / "h2o_compress" / "evaluation" / "cli.py").exists()


def test_console_script_entry_point_is_kept():
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'h2o-compress = "h2o_compress.cli:main"' in pyproject
    from h2o_compress.cli import main

    assert callable(main)


# -- settings that make no sense together -------------------------------------------------------------------------------
@pytest.mark.parametrize("config,capacity", [
    (CompressionConfig(), None), (CompressionConfig(policy="full"), None), (CompressionConfig(budget=0.2), 1),
    (CompressionConfig(policy="sink", budget=5), None), (CompressionConfig(budget=2, heavy_ratio=0.5), None),
    (CompressionConfig(policy="local", budget=1), None), (CompressionConfig(heavy_ratio=0.99, budget=0.5), 200),
])
def test_usable_settings_pass(config, capacity):
    assert check_usable(config, capacity) is config


@pytest.mark.parametrize("config,capacity,message", [
    (CompressionConfig(budget=20, sink_tokens=50), None, "a capacity of 20 tokens"),
    (CompressionConfig(policy="sink", budget=4), None, "sink_tokens=4"),
    (CompressionConfig(budget=0.2, heavy_ratio=1.0), None, "heavy_ratio=1.0 leaves no recent window"),
    (CompressionConfig(policy="h2o-mean", budget=0.2, heavy_ratio=1.0), None, "heavy_ratio=1.0"),
    (CompressionConfig(budget=0.2, heavy_ratio=0.9, sink_tokens=4), 4, "a capacity of 4 tokens"),
    (CompressionConfig(policy="full", budget=0.1), None, "policy='full' keeps every token, so budget=0.1"),
    (CompressionConfig(policy="full", budget=64), None, "budget=64 would be ignored"),
])
def test_settings_without_a_recent_window_are_refused(config, capacity, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_usable(config, capacity)


# -- plots --------------------------------------------------------------------------------------------------------------
def test_one_colour_per_policy_and_one_marker_per_bit_width():
    from h2o_compress.config import ALLOWED_BITS
    from h2o_compress.policies import POLICIES
    from h2o_compress.profiling.report import bits_marker, policy_color

    colours = [policy_color(p) for p in POLICIES]
    assert len(set(colours)) == len(colours), dict(zip(POLICIES, colours))
    markers = [bits_marker(b) for b in ALLOWED_BITS]
    assert len(set(markers)) == len(markers)


# -- the converted-model cache directory ------------------------------------------------------------------------------
def test_empty_cache_variable_means_unset(monkeypatch):
    from h2o_compress.utils.paths import cache_root

    monkeypatch.setenv("H2O_COMPRESS_CACHE", "")
    assert cache_root() == Path.home() / ".cache" / "h2o-compress"
    monkeypatch.setenv("H2O_COMPRESS_CACHE", "  ")
    assert cache_root() == Path.home() / ".cache" / "h2o-compress"


def test_unusable_cache_directory_is_refused(tmp_path):
    import os

    from h2o_compress.utils.paths import check_cache_root

    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is not a directory"):
        check_cache_root(tmp_path / "file")
    with pytest.raises(ConfigError, match="is not a directory"):
        check_cache_root(tmp_path / "file" / "below")
    assert check_cache_root(tmp_path / "new") == tmp_path / "new"
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="is not writable"):
            check_cache_root(locked)


# -- start-up: what the CLI imports before a command runs ------------------------------------------------------------
_HEAVY = ("torch", "transformers")


def _cli_in_subprocess(*argv: str, env: dict | None = None) -> dict:
    """Run the console-script entry (``h2o_compress.cli:main``) on ``argv`` in a fresh interpreter; what it printed,
    its exit code, which heavy modules it had imported by then and its ``OMP_WAIT_POLICY``."""
    code = (
        "import json, os, sys\n"
        f"sys.argv = ['h2o-compress', *{list(argv)!r}]\n"
        "from h2o_compress.cli import main\n"
        "try:\n    main()\n    code = 0\n"
        "except SystemExit as exc:\n    code = exc.code\n"
        f"print(json.dumps({{'code': code, 'heavy': [m for m in {_HEAVY!r} if m in sys.modules],"
        " 'omp': os.environ.get('OMP_WAIT_POLICY')}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "COLUMNS": "100", **(env or {})})
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {**result, "stdout": out.stdout, "stderr": out.stderr}


@pytest.mark.parametrize("argv", [("--help",), ("--version",), (), ("genrate",), ("eval-x", "--help")])
def test_the_top_level_help_version_and_a_mistyped_command_import_neither_torch_nor_transformers(argv):
    run = _cli_in_subprocess(*argv)
    assert run["heavy"] == [], run
    if argv == ("--version",):
        assert run["code"] == 0 and re.search(r"h2o-compress \d+\.\d+", run["stdout"])
    elif argv == ("--help",):
        assert run["code"] == 0 and all(name in run["stdout"] for name in ("generate", "calibrate", "eval"))
    else:  # no command (help, exit 2 as typer's no_args_is_help) or no such command: one usage error
        assert run["code"] == 2, run
    if argv == ("genrate",):
        assert "No such command 'genrate'" in run["stderr"] and "generate" in run["stderr"]


def test_a_command_module_is_imported_when_that_command_runs():
    run = _cli_in_subprocess("plan", "--help")
    assert run["code"] == 0 and "--memory" in run["stdout"] and "torch" in run["heavy"]


def test_the_cli_runs_torch_with_sleeping_openmp_threads_unless_the_environment_says_otherwise():
    assert _cli_in_subprocess("--version")["omp"] == "PASSIVE"
    assert _cli_in_subprocess("--version", env={"OMP_WAIT_POLICY": "ACTIVE"})["omp"] == "ACTIVE"


def test_importing_the_package_loads_no_torch_and_every_export_still_imports():
    code = ("import sys, h2o_compress\nassert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
            "from h2o_compress import CompressionConfig, load_model, __version__\n"
            "missing = [n for n in h2o_compress.__all__ if getattr(h2o_compress, n, None) is None]\n"
            "print(missing, sorted(set(h2o_compress.__all__) - set(dir(h2o_compress))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "[] []", out.stderr
    import h2o_compress

    with pytest.raises(AttributeError, match="no attribute 'not_an_export'"):
        h2o_compress.not_an_export  # noqa: B018


def test_each_command_listed_without_importing_it_is_summarised_as_its_own_help_says():
    from h2o_compress.cli import COMMANDS, click_app

    assert list(click_app.commands) == list(COMMANDS)  # every command, in the order --help lists them
    for name, declared in COMMANDS.items():
        command = click_app.commands[name]
        own = " ".join((command.help or "").split("\n\n")[0].split())
        assert declared.summary == own, (name, declared.summary, own)
        real = getattr(command, "commands", None) or [p for p in command.params if p.param_type_name == "option"]
        assert real, name  # the real command, options (or a group's commands) and all
    listed = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "400"}).stdout
    for name, declared in COMMANDS.items():
        assert declared.summary[:60] in " ".join(listed.split()), name


def test_a_conversion_bar_shows_counts_once_its_total_is_known_and_no_question_mark_before():
    from rich.progress import MofNCompleteColumn

    from h2o_compress.cli.progress import _progress

    bar = _progress()
    unknown, known = bar.add_task("tokenizer", total=None), bar.add_task("weights", total=272, completed=3)
    counts = next(column for column in bar.columns if isinstance(column, MofNCompleteColumn))
    assert str(counts.render(bar.tasks[unknown])) == ""
    assert str(counts.render(bar.tasks[known])).replace(" ", "") == "3/272"

"""lm-evaluation-harness tasks: checking task options before anything runs, and scoring an already-loaded model
with the ``h2o-compress`` model type (`h2o_compress.integrations.lm_eval_model`). Shared by ``h2o-compress eval lm-eval``
and ``h2o-compress profile --lm-eval-tasks`` (lm-eval: https://github.com/EleutherAI/lm-evaluation-harness).

A leaf module: ``lm_eval`` and the model type are imported only when a function needs them, so importing this module
never needs the ``lm-eval`` extra.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from h2o_compress.utils.errors import ConfigError, InputError, short
from h2o_compress.utils.checks import check_count, is_real

LM_EVAL_EXTRA = "pip install -e '.[lm-eval]' (lm_eval>=0.4.13)"
SKIPPED_KEYS = ("name", "alias", "sample_len")
_MANAGERS: dict = {}


def import_lm_eval():
    """The ``lm_eval`` package.

    Raises:
        ConfigError: lm-evaluation-harness is not installed (the message names the extra that installs it).
    """
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager  # noqa: F401
    except ImportError:
        raise ConfigError(f"lm-evaluation-harness is not installed; allowed: {LM_EVAL_EXTRA}") from None
    return lm_eval


def task_manager(include_path: str | None = None):
    """lm-eval's ``TaskManager`` (its own tasks plus those under ``include_path``), built once per process and
    folder: indexing lm-eval's ~10k task files takes seconds.

    Raises:
        ConfigError: lm-eval not installed.
    """
    import_lm_eval()
    from lm_eval.tasks import TaskManager

    key = (TaskManager, include_path)  # a replaced TaskManager (tests) gets its own entry
    if key not in _MANAGERS:
        _MANAGERS[key] = TaskManager(include_path=include_path)
    return _MANAGERS[key]


def check_tasks(tasks: Sequence[str], limit: int | None = None, include_path: str | None = None,
                option: str = "--tasks", index: bool = True):
    """Check lm-eval task options before anything is loaded: at least one task name, ``limit`` a count >= 1,
    ``include_path`` a directory, then (``index`` true) every name against lm-eval's tasks and those under
    ``include_path``. ``index`` false: the checks that need no task index (nor lm-eval), for a command's first
    look at its options.

    Returns:
        The `task_manager` that knows the tasks (``index`` false: ``None``).

    Raises:
        ConfigError: lm-eval not installed, no task, a bad ``limit``, or an unknown task name (naming each one).
        InputError: ``include_path`` is not a directory.
    """
    if not tasks or any(not isinstance(name, str) or not name.strip() for name in tasks):
        raise ConfigError(f"{option} {short(', '.join(map(str, tasks)))} names no task (or an empty one); allowed: "
                          "lm-eval task names, comma-separated")
    if limit is not None:
        check_count("limit", limit, unit="documents")
    if include_path is not None and not Path(include_path).is_dir():
        raise InputError(f"--include-path {short(include_path)} is not a directory; allowed: a folder of task YAML files")
    if not index:
        return None
    manager = task_manager(include_path)
    unknown = [name for name in tasks if not manager.match_tasks([name])]
    if unknown:
        raise ConfigError(
            f"unknown lm-eval task(s) {', '.join(map(short, unknown))}; allowed: a task lm-eval knows (lm-eval ls tasks)"
            " or one defined under --include-path"
        )
    return manager


def flat_scores(results: dict) -> dict[str, dict[str, float]]:
    """``{task: {"metric,filter": value}}`` of lm-eval's ``results["results"]`` (numbers only; each metric's
    ``..._stderr,filter`` kept beside it, lm-eval's ``"N/A"`` stderr as ``None``)."""
    scores: dict[str, dict] = {}
    for task, metrics in results.get("results", {}).items():
        row = {}
        for key, value in metrics.items():
            if key in SKIPPED_KEYS or "," not in key:
                continue
            row[key] = value if is_real(value) else None
        scores[task] = row
    return scores


def score_model(model, tokenizer, config, tasks: Sequence[str], limit: int | None = None,
                include_path: str | None = None) -> dict:
    """Score an already-loaded model on lm-eval ``tasks`` through the compressed cache of ``config`` (the
    ``h2o-compress`` model type, `H2OCompressLM`; no second model load).

    Args:
        model: a loaded causal LM.
        tokenizer: its tokenizer.
        config: the [`CompressionConfig`][h2o_compress.CompressionConfig] of every request.
        tasks: as ``h2o-compress eval lm-eval --tasks``.
        limit: as ``h2o-compress eval lm-eval --limit``.
        include_path: as ``h2o-compress eval lm-eval --include-path``.

    Returns:
        ``{"tasks": list, "limit": limit, "scores": {task: {"metric,filter": value, "metric_stderr,filter": value}},
        "versions": {task: version}}``.

    Raises:
        ConfigError / InputError: bad task options (`check_tasks`) or a bad compression setting.
    """
    lm_eval = import_lm_eval()
    manager = check_tasks(tasks, limit, include_path)
    from h2o_compress.integrations.lm_eval_model import H2OCompressLM  # deferred: needs lm_eval (optional)

    lm = H2OCompressLM(pretrained=model, tokenizer=tokenizer, **config.to_dict())
    results = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), limit=limit, task_manager=manager,
                                      log_samples=False)
    return {"tasks": list(tasks), "limit": limit, "scores": flat_scores(results),
            "versions": {k: v for k, v in (results.get("versions") or {}).items() if k in tasks}}

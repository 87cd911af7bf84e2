"""``h2o-compress eval lm-eval``: lm-evaluation-harness tasks through the compressed cache (model type ``h2o-compress``,
`h2o_compress.integrations.lm_eval_model`), scores as a rich table, optionally written to a JSON file.

Every option is checked before the model loads: the model_args (keys and compression values), the task names
(against lm-eval's tasks and those under ``--include-path``), ``--limit`` and ``--output`` (a new file only).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from h2o_compress.utils.errors import ConfigError, InputError, short
from h2o_compress.integrations.lm_eval_tasks import SKIPPED_KEYS, check_tasks, import_lm_eval
from h2o_compress.cli.common import fail, set_threads, user_errors
from h2o_compress.cli.options import JsonOpt, ThreadsOpt


def split_tasks(tasks: str, option: str = "--tasks") -> list[str]:
    """The task names of a comma-separated option value. Raises ConfigError when it names none."""
    task_list = [name.strip() for name in tasks.split(",") if name.strip()]
    if not task_list:
        raise ConfigError(f"{option} {short(tasks)} names no task; allowed: lm-eval task names, comma-separated")
    return task_list


@dataclass(frozen=True)
class LmEvalRequest:
    """What ``eval lm-eval`` was asked, validated once, when made (before lm-eval or the model loads): the
    ``model_args`` (keys and compression values: `check_model_args`), the task names (comma-separated), ``--limit``
    and ``--include-path`` (`check_tasks`), and ``--output``, a new file in a writable folder (nothing the
    user has is overwritten) or ``None``.

    Raises (when made):
        ConfigError: a bad model argument, task option, or no task named.
        InputError: an ``--output`` that exists, or whose folder is not a writable directory.
    """

    model_args: dict
    tasks: str
    limit: Optional[int] = None
    include_path: Optional[str] = None
    output: Optional[str] = None

    def __post_init__(self) -> None:
        from h2o_compress.integrations.lm_eval_model import check_model_args  # deferred: needs lm_eval (optional)

        check_model_args(self.model_args)
        object.__setattr__(self, "tasks", split_tasks(self.tasks))
        check_tasks(self.tasks, self.limit, self.include_path, index=False)
        if self.output is None:
            return
        path = Path(self.output)
        if path.exists():
            raise InputError(f"--output {short(self.output)} exists; allowed: a new file (nothing is overwritten)")
        if not path.parent.is_dir() or not os.access(path.parent, os.W_OK):
            raise InputError(f"--output {short(self.output)}: its folder is not a writable directory; allowed: a new "
                             "file there")


def score_rows(results: dict) -> list[tuple[str, str, str, str, str]]:
    """``(task, metric, filter, value, stderr)`` for each metric of lm-eval's ``results["results"]``."""
    rows = []
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if key in SKIPPED_KEYS or "_stderr," in key or "," not in key:
                continue
            metric, filter_name = key.split(",", 1)
            stderr = metrics.get(f"{metric}_stderr,{filter_name}", "")
            fmt = lambda v: f"{v:.4f}" if isinstance(v, (int, float)) else str(v)  # noqa: E731
            rows.append((task, metric, filter_name, fmt(value), fmt(stderr)))
    return rows


@user_errors
def lm_eval_command(
    tasks: str = typer.Option(..., "--tasks", help="lm-eval task names, comma-separated (e.g. lambada_openai,hellaswag)."),
    model_args: str = typer.Option(
        "pretrained=smollm2-135m", "--model-args",
        help="key=value,... : pretrained (alias, directory or hub id), the compression (budget, kv_bits, policy, "
             "heavy_ratio, ...: the fields of CompressionConfig), device, dtype, chunk_size (rolling loglikelihood)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="At most N documents per task."),
    include_path: Optional[str] = typer.Option(None, "--include-path", help="A folder of extra task YAML files."),
    output: Optional[str] = typer.Option(None, "--output", help="Write lm-eval's results as JSON to this new file."),
    threads: Optional[int] = ThreadsOpt,
    as_json: bool = JsonOpt,
):
    """lm-evaluation-harness tasks with the compressed cache: loglikelihood scored against the compressed context,
    generation decoded with the cache, rolling loglikelihood streamed through it."""
    lm_eval = import_lm_eval()
    from lm_eval.utils import handle_non_serializable, simple_parse_args_string

    from h2o_compress.integrations.lm_eval_model import MODEL_TYPE  # deferred: needs lm_eval (optional)

    request = LmEvalRequest(simple_parse_args_string(model_args), tasks, limit, include_path, output)
    args, task_list = request.model_args, request.tasks
    set_threads(threads)
    manager = check_tasks(task_list, limit, include_path)
    try:
        results = lm_eval.simple_evaluate(
            model=MODEL_TYPE, model_args=args, tasks=task_list, limit=limit, task_manager=manager, log_samples=False,
        )
    except OSError as exc:  # a task's data set that is neither cached nor reachable (datasets' ConnectionError)
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        fail(f"lm-eval could not read the data of task(s) {', '.join(task_list)}: {reason}; allowed: tasks whose "
             "data sets are in the local Hugging Face cache (this machine may be offline), or local tasks "
             "(--include-path DIR)")
    if output is not None:  # written whole, as a new file: never over one that appeared meanwhile, no symlink followed
        handle, partial = tempfile.mkstemp(prefix=".lm-eval-", suffix=".partial", dir=Path(output).absolute().parent)
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as out:
                out.write(json.dumps(results, indent=2, default=handle_non_serializable))
            os.link(partial, output)
        except FileExistsError:
            fail(f"--output {short(output)} appeared while lm-eval ran; it is not replaced (the results are in "
                 f"{partial})")
        else:
            os.unlink(partial)
    if as_json:
        typer.echo(json.dumps(results.get("results", {}), default=handle_non_serializable))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"lm-eval scores ({model_args})")
    for name in ("task", "metric", "filter", "value", "stderr"):
        table.add_column(name, justify="left" if name in ("task", "metric", "filter") else "right")
    for row in score_rows(results):
        table.add_row(*row)
    Console().print(table)

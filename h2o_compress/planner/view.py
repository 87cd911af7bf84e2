"""Rich rendering of a [`PlanReport`][h2o_compress.planner.PlanReport] (the ``h2o-compress plan`` table)."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from h2o_compress.planner.plan import PlanReport, PlanRow
from h2o_compress.planner.units import format_bytes


def plan_table(report: PlanReport) -> Table:
    """One row per candidate: capacity, KV cache bytes (and their share of the uncompressed cache: fp16 keys and
    values plus a hybrid's constant states), of which constant states (hybrids only), workspace, total, fit, max
    batch and max context, and the quality figure that orders the rows (the measured ranking's perplexity ratio,
    ``<=`` where bounded by a measured setting the row keeps at least as much as; or the profile report's metric);
    the recommended row in bold green."""
    d = report.dims
    table = Table(box=box.SIMPLE_HEAD, title=(
        f"{report.model}: {_layers(report)} x {d.kv_heads} KV heads x {d.head_dim} head_dim | "
        f"batch {report.batch}, prompt {report.prompt_len} + gen {report.gen_len} tokens | "
        f"limit {format_bytes(report.memory_limit)}"
        + (f" less {format_bytes(report.headroom_bytes)} headroom" if report.headroom_bytes else "")
    ))
    hybrid = any(row.cache.all_states for row in report.rows)
    for name in ("setting", "capacity", "KV cache", "of fp16", *(("states",) if hybrid else ()),
                 "workspace", "total", "fits", "max batch", "max context"):
        if name == "setting":
            table.add_column(name, no_wrap=True, min_width=max(len(row.label) for row in report.rows))
        else:
            table.add_column(name, justify="right")
    table.add_column("quality", justify="right")
    for row in report.rows:
        uncompressed = report.fp16_cache_bytes + row.cache.states
        share = row.cache.total / uncompressed if uncompressed else 0.0
        beyond = report.model_context and row.max_context > report.model_context
        cells = [
            row.label, "all" if row.cache.capacity is None else str(row.cache.capacity),
            format_bytes(row.cache.total), f"{share:.1%}",
            *((format_bytes(row.cache.all_states),) if hybrid else ()), format_bytes(row.workspace_bytes),
            format_bytes(row.total_bytes), "yes" if row.fits else "no", f"{row.max_batch:,}",
            f"{row.max_context:,}" + ("*" if beyond else ""),
        ]
        cells.append(_quality_cell(row, report.order))
        style = "bold green" if row is report.recommended else (None if row.fits else "dim")
        table.add_row(*cells, style=style)
    return table


def _quality_cell(row: PlanRow, order: str) -> str:
    """``1.036x`` (measured), ``<=1.073x`` (bounded by another measured setting), the profile's metric, or ``-``."""
    if row.quality is None:
        return "-"
    if order != "measured":
        return f"{abs(row.quality):.4g}"
    return ("" if row.quality_from == row.label else "<=") + f"{row.quality:.3f}x"


def _layers(report: PlanReport) -> str:
    """``"32 layers"``, or for a hybrid the layers that attend: ``"4 of 40 layers"``."""
    d = report.dims
    attending = d.num_layers - sum(span.stateful for span in d.spans)
    return f"{d.num_layers} layers" if attending == d.num_layers else f"{attending} of {d.num_layers} layers"


def _states_line(report: PlanReport) -> str:
    """The header line of a hybrid: its constant states, per sequence and for the batch."""
    outside = report.rows[0].cache.model_states if report.rows else 0
    where = "held by the model's own modules, in the total" if outside else "uncompressed, in the KV cache column"
    return (f"constant states ({report.state_layers} linear-attention/SSM/conv layers): "
            f"{format_bytes(report.state_bytes // report.batch)} per sequence, {format_bytes(report.state_bytes)} "
            f"here, at any length ({where})")


def print_plan(report: PlanReport, console: Console | None = None) -> None:
    """Print the header figures, the table, the recommendation and the footnotes."""
    if console is None:  # never squeeze numbers: rich assumes 80 columns when piped
        console = Console()
        console = Console(width=max(console.width, 132))
    per_token = report.dims.fp16_bytes_per_token
    console.print(
        f"weights {format_bytes(report.weight_bytes)} ({report.weights_bits}-bit, compute {report.dtype}); "
        f"uncompressed fp16 KV cache {format_bytes(per_token)}/token, {format_bytes(report.fp16_cache_bytes)} here"
    )
    if report.state_bytes:
        console.print(_states_line(report))
    console.print(plan_table(report))
    best = report.recommended
    if best is None:
        smallest = min(report.rows, key=lambda r: r.total_bytes)
        console.print(f"[bold red]nothing fits[/]: the smallest, {smallest.label}, needs "
                      f"{format_bytes(smallest.total_bytes)}")
    else:
        console.print(f"[bold]recommended[/]: {best.label} ({report.reason}): total {format_bytes(best.total_bytes)} "
                      f"of {format_bytes(report.memory_limit)}")
    console.print(f"quality ranking: {report.ranking}", highlight=False)
    if report.headroom_bytes:
        left = f"; {format_bytes(report.memory_limit - best.total_bytes)} of the limit left in all" if best else ""
        console.print(f"headroom: {format_bytes(report.headroom_bytes)} of the limit left free (--headroom), so "
                      f"settings fit within {format_bytes(report.usable_bytes)}{left}")
    if report.model_context and any(row.max_context > report.model_context for row in report.rows):
        console.print(f"* beyond the model's context window of {report.model_context:,} tokens")
    pool = ", with the CUDA-graph pool of the compiled decode step" if report.compiled else ""
    console.print(f"KV cache bytes are exact; workspace is an estimate{pool} (no CUDA context, no fragmentation).")
    for note in report.notes:
        console.print(f"note: {note}")

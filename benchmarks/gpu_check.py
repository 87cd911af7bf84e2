"""The project's one prepared GPU check: everything a lent H100/H200 should measure, in priority order, inside 8
minutes, writing its results as it goes (a run cut short still reports what it finished).

    # here, once (no GPU needed): wheels the device image lacks, into .whl/ (ignored by git)
    python benchmarks/gpu_check.py --prepare
    # on the GPU machine (the device tool's `run`, carry [".whl"]):
    python3 benchmarks/gpu_check.py --wheels .whl --out $OUT
    # on a CPU, every section end to end at tiny sizes (CI runs it; --smoke is the same):
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu-check

Sections, each a subprocess under its own time cap (the caps add up to the 8-minute budget; a section that would
start with less than 30 s of the budget left is skipped and recorded so), each with its figures in the report:

1. ``environment``: the device, torch, Triton, transformers, the package's import.
2. ``cuda-tests`` (a): ``pytest -m cuda`` over ``tests/test_cuda.py`` and the Triton attention tests, all but the
   64-step comparison (section 4 measures it); figures: pytest's counts (on a CPU every test is skipped).
3. ``triton-vs-torch`` (a): our compressed decode through the Triton op against its torch form, h2o int4 / int8 /
   16-bit, 64 steps with evictions; figures: the largest logits difference and whether the same tokens are kept.
   On a CPU: Triton's interpreter, int4 and 16-bit, 8 steps; without Triton a row saying why it was skipped.
4. ``compiled-vs-eager`` (b): 64 teacher-forced decode steps of h2o int4, the compiled step (CUDA: Inductor with
   CUDA graphs, ``compiled_decode_step``, the Triton op) against the eager torch form; figures: the largest logits
   difference, the same tokens kept, the compile seconds. On a CPU the capture runs under Dynamo's ``aot_eager``
   backend (``--cpu-compile inductor``: Inductor, whose cold compile is slow on a small CPU), and the row
   says which.
5. ``decode-speed`` (c): decode tokens/s at 4k and 16k context, batch 16, ours ``h2o 0.2 int4`` (eager and
   compiled) against transformers' ``StaticCache`` + ``torch.compile``, in one run (``gpu_throughput.py``, LLaMA-7B
   shape, 8 layers, random weights).
6. ``peak-vs-planner`` (d): the measured peak memory of a prefill and decode at 4k x 16 (uncompressed
   ``StaticCache`` and ours ``h2o 0.2 int4``) against the planner's total (weights + cache + workspace): CUDA's
   ``max_memory_allocated``; on a CPU torch's allocations in the profiler's memory events, plus the weights.
7. ``max-batch`` (e): the largest batch at a 24 GiB memory limit, 16k context, ours against the uncompressed cache
   (the planner's prediction, confirmed by a run).

Output, in ``--out``: ``gpu_check.json`` and ``gpu_check.md`` (rewritten after every section: status, seconds,
figures, the command, the tail of its output), and the files ``gpu_throughput.py`` writes (``gpu_check_speed.*``,
``gpu_check_maxbatch.*``): at most 8 files, as the device tool brings back. A section's own figures are the lines
``FIGURE {json}`` it prints, read back from a section stopped at its cap too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Packages the device image lacks or holds at another version (the image's transformers is older than the pin).
WHEELS = ("transformers==5.23.0", "gguf==0.19.0")
CUDA_TESTS = ["tests/test_cuda.py", "tests/attention/test_slot_attention.py", "tests/attention/test_triton_layer.py"]
#: The CUDA test that section 4 measures with figures (64 steps compiled against eager).
MEASURED_ELSEWHERE = "not 64_steps"
BUDGET_MINUTES = 8.0


@dataclass
class Step:
    """One section of the check: ``command`` run under ``limit_s`` seconds; ``source`` says where its figures come
    from (``lines``: its ``FIGURE`` lines, ``pytest``: the counts pytest prints, ``speed`` / ``max_batch``: the rows
    of the JSON ``gpu_throughput.py`` writes as ``name``)."""

    name: str
    section: str
    what: str
    command: list[str]
    limit_s: float
    source: str = "lines"
    json_name: str = ""
    status: str = "not run"
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    figures: list = field(default_factory=list)
    output_tail: str = ""


def steps_for(args) -> list[Step]:
    """The sections in priority order, sized for a GPU or (``--dry-run``) for a run of every section on a CPU."""
    python, out, dry = sys.executable, str(args.out), args.dry_run
    pytest = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-m", "cuda", "-o",
              "addopts="]
    own = [python, str(Path(__file__).resolve()), *(["--dry-run"] if dry else []), "--cpu-compile", args.cpu_compile,
           "--section"]
    throughput = [python, "benchmarks/gpu_throughput.py", "--out", out]
    if dry:  # tiny LLaMA, contexts 96 / 192; the speed cells get room for StaticCache + compile to fit
        throughput += ["--smoke", "--device", "cpu"]
        speed = ["--cells", "96x4,192x4", "--memory", "64MiB"]
        maxbatch = ["--maxbatch-contexts", "192"]
    else:
        speed = ["--layers", "8", "--cells", "4096x16,16384x16", "--max-minutes", "2"]
        maxbatch = ["--layers", "8", "--maxbatch-contexts", "16384", "--memory", "24GiB", "--max-batch-limit", "256",
                    "--max-minutes", "0.5"]
    return [
        Step("environment", "-", "device, versions, the package's import", [python, "-c", ENVIRONMENT], 20),
        Step("cuda-tests", "a", "pytest -m cuda: the CUDA tests and the Triton kernels' tests",
             pytest + CUDA_TESTS + ["-k", MEASURED_ELSEWHERE], 110, source="pytest"),
        Step("triton-vs-torch", "a", "our decode through the Triton op against its torch form", own + ["triton"], 40),
        Step("compiled-vs-eager", "b", "compiled decode step against eager: logits and kept tokens over 64 steps",
             own + ["compiled"], 70),
        Step("decode-speed", "c", "decode tokens/s at 4k and 16k x 16: ours h2o 0.2 int4 (eager, compiled) vs "
             "StaticCache + compile", throughput + speed + ["--parts", "speed", "--settings",
                                                           "sdpa-static+compile,h2o0.2-4,h2o0.2-4+compile",
                                                           "--name", "gpu_check_speed"], 140,
             source="speed", json_name="gpu_check_speed"),
        Step("peak-vs-planner", "d", "measured peak memory of a prefill and decode against the planner's total",
             own + ["memory"], 40),
        Step("max-batch", "e", "largest batch at a memory limit, ours h2o 0.2 int4 vs uncompressed, 16k",
             throughput + maxbatch + ["--parts", "maxbatch", "--settings", "sdpa-dynamic,h2o0.2-4", "--name",
                                      "gpu_check_maxbatch"], 60, source="max_batch", json_name="gpu_check_maxbatch"),
    ]


ENVIRONMENT = """
import json, torch, transformers, h2o_compress
info = {"torch": torch.__version__, "transformers": transformers.__version__, "h2o_compress": h2o_compress.__version__,
        "cuda": torch.cuda.is_available(), "device": "cpu"}
if info["cuda"]:
    props = torch.cuda.get_device_properties(0)
    info.update(device=props.name, memory_GiB=round(props.total_memory / 2**30, 1), capability=f"{props.major}.{props.minor}")
try:
    import triton
    info["triton"] = triton.__version__
except ImportError:
    info["triton"] = None
print("FIGURE " + json.dumps(info))
"""
#: pytest's closing counts ("3 passed, 26 skipped, 47 deselected in 1.0s").
PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)\b")
#: The fields of gpu_throughput.py's rows kept as a section's figures.
SPEED_FIELDS = ("setting", "context", "batch", "status", "decode_tokens_per_s", "kv_bytes", "peak_bytes", "kernel")
MAXBATCH_FIELDS = ("setting", "context", "predicted", "confirmed", "decode_tokens_per_s", "limit")


def figures_of(step: Step, output: str, out: Path) -> list:
    """The figures of a finished (or stopped) section: its ``FIGURE`` lines, pytest's counts, or the rows of the
    JSON ``gpu_throughput.py`` wrote (saved after every row, so a stopped section keeps the rows it finished)."""
    if step.source == "lines":
        return [json.loads(line[len("FIGURE "):]) for line in output.splitlines() if line.startswith("FIGURE {")]
    if step.source == "pytest":
        summary = [line for line in output.splitlines() if PYTEST_COUNT.search(line)]
        counts = {kind.rstrip("s") if kind.startswith("error") else kind: int(n)
                  for n, kind in PYTEST_COUNT.findall(summary[-1])} if summary else {}
        return [counts] if counts else []
    path = out / f"{step.json_name}.json"
    if not path.exists():
        return []
    keep = SPEED_FIELDS if step.source == "speed" else MAXBATCH_FIELDS
    return [{k: row.get(k) for k in keep} for row in json.loads(path.read_text()).get(step.source, [])]


def run_step(step: Step, env: dict, deadline: float, out: Path) -> None:
    """Run ``step`` under the smaller of its own cap and what is left of the total budget; record the outcome."""
    left = deadline - time.monotonic()
    if left < min(30.0, step.limit_s):
        step.status = "skipped: the check's time budget is spent"
        return
    started, used = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        done = subprocess.run(step.command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=min(step.limit_s, left))
        step.status = "passed" if done.returncode == 0 else f"failed (exit {done.returncode})"
        output = done.stdout + done.stderr
    except subprocess.TimeoutExpired as stopped:
        step.status = f"stopped at its cap ({min(step.limit_s, left):.0f} s)"
        output = "".join(part.decode(errors="replace") if isinstance(part, bytes) else part or ""
                         for part in (stopped.stdout, stopped.stderr))
    step.seconds = round(time.monotonic() - started, 1)
    now = resource.getrusage(resource.RUSAGE_CHILDREN)  # the section's CPU time: a figure a busy machine keeps
    step.cpu_seconds = round(now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime, 1)
    step.figures = figures_of(step, output, out)
    step.output_tail = output[-3000:]


def write(out: Path, steps: list[Step], header: dict) -> None:
    """``gpu_check.json`` and ``gpu_check.md`` as they stand."""
    (out / "gpu_check.json").write_text(json.dumps({**header, "steps": [asdict(s) for s in steps]}, indent=1))
    lines = [f"# GPU check ({header['started']})", "", f"`{header['command']}`", "",
             f"- machine: {header['machine']}", f"- dry run (CPU, tiny sizes): {header['dry_run']}", "",
             "| section | step | what | status | seconds | CPU seconds | figure rows |", "|---|---|---|---|---:|---:|---:|"]
    lines += [f"| {s.section} | {s.name} | {s.what} | {s.status} | {s.seconds} | {s.cpu_seconds} | {len(s.figures)} |"
              for s in steps]
    for s in steps:
        if s.figures:
            lines += ["", f"## {s.name}: figures", "", *(f"- `{json.dumps(row)}`" for row in s.figures)]
        if s.output_tail:
            lines += ["", f"## {s.name}: output", "", "```", s.output_tail.strip()[-1500:], "```"]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def prepare(target: Path) -> None:
    """Download the wheels the device image lacks (Python 3.12, manylinux x86-64) into ``target``."""
    target.mkdir(exist_ok=True)  # ignored by .gitignore: it travels to the device only as a carried path
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
                    "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform",
                    "manylinux_2_17_x86_64", "-d", str(target), *WHEELS], check=True)
    print(f"wheels in {target}; on the device: python3 benchmarks/gpu_check.py --wheels {target.name} --out $OUT "
          f"(carry [\"{target.name}\"])")


def environment(args) -> dict:
    """The children's environment: the package from this checkout, the carried wheels first on the path."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    if args.wheels:
        site = Path("/tmp/gpu-check-site")
        wheels = sorted(str(p) for p in Path(args.wheels).glob("*.whl"))
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--upgrade", "--target", str(site), *wheels], check=True)
        env["PYTHONPATH"] = f"{site}:{ROOT}"
    if args.dry_run:
        env["TRITON_INTERPRET"] = "1"
    return env


# --- the sections this script runs itself (``--section NAME``, in a child process) ---------------------------------

#: Model fields, batch, prompt tokens and the Triton comparison's decode steps: on a GPU (head_dim 128 as LLaMA's)
#: and in a dry run (the tests' tiny LLaMA).
SIZES = {"gpu": (dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                      intermediate_size=2048, vocab_size=1000), 8, 1024, 64),
         "dry": (dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      intermediate_size=96, vocab_size=128), 2, 40, 8)}


def tiny_model(fields: dict, device, dtype):
    """A 2-layer LLaMA with random weights (seed 0) on ``device`` in ``dtype``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, max_position_embeddings=4096, attn_implementation="sdpa", **fields)
    return LlamaForCausalLM(config).eval().to(device, dtype)


def teacher_forced(model, kernel: str, step, bits: int, sizes: tuple, steps: int):
    """Prefill a random prompt into a new h2o cache (budget a fifth of the prompt, at least 24 tokens: an eviction
    every step) and run ``steps`` decode steps of given tokens through ``step``; returns (logits ``[steps, batch,
    vocab]`` fp32, the cache)."""
    import dataclasses

    import torch

    from h2o_compress import CompressionConfig, make_cache
    from h2o_compress.runtime.compiled import decode_one

    _, batch, prompt_tokens, _ = sizes
    device, vocab = next(model.parameters()).device, model.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (batch, prompt_tokens), generator=generator).to(device)
    tokens = torch.randint(0, vocab, (batch, steps), generator=generator).to(device)
    config = CompressionConfig(budget=max(24, prompt_tokens // 5), kv_bits=bits, residual=2)
    cache = make_cache(model, dataclasses.replace(config, attention_kernel=kernel), max_length=prompt_tokens + steps)
    with torch.inference_mode():
        model(input_ids=prompt, past_key_values=cache)
        logits = [decode_one(step, model, cache, tokens[:, i:i + 1], prompt_tokens + i).clone() for i in range(steps)]
    return torch.stack(logits).float(), cache


def compare(ours, reference, cache, reference_cache, tolerance: float) -> dict:
    """The figures of one comparison: the largest logits difference, whether every layer keeps the same tokens."""
    import torch

    kept = [torch.equal(a.positions(), b.positions()) for a, b in zip(cache.layers, reference_cache.layers)]
    difference = (ours - reference).abs().max().item()
    return {"max_abs_logits_diff": difference, "tolerance": tolerance, "same_tokens_kept": all(kept),
            "kernel": getattr(cache, "decode_kernel", None), "ok": difference <= tolerance and all(kept)}


def section_triton(args) -> bool:
    """Section 3: the Triton op against the torch form, per KV format; a skipped row on a CPU without Triton."""
    import torch

    from h2o_compress.runtime.compiled import decode_step

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        figure(bits=None, skipped=f"Triton is not installed here ({exc}); the torch form alone runs on this CPU")
        return device.type == "cpu"
    sizes = SIZES["dry" if args.dry_run else "gpu"]
    cuda = device.type == "cuda"
    model = tiny_model(sizes[0], device, torch.float16 if cuda else torch.float32)
    ok = True
    for bits in (4, 8, 16) if cuda else (4, 16):
        reference, reference_cache = teacher_forced(model, "torch", decode_step, bits, sizes, sizes[3])
        ours, cache = teacher_forced(model, "triton", decode_step, bits, sizes, sizes[3])
        row = compare(ours, reference, cache, reference_cache, 2e-2 if cuda else 2e-4)
        figure(bits=bits, steps=sizes[3], device=device.type, interpreter=not cuda, **row)
        ok &= row["ok"]
    return ok


def section_compiled(args) -> bool:
    """Section 4: 64 steps of h2o int4, compiled (CUDA: Inductor + CUDA graphs, the Triton op; CPU:
    ``--cpu-compile``) against the eager torch form."""
    import torch

    from h2o_compress.runtime.compiled import compiled_decode_step, decode_step

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    sizes = SIZES["dry" if args.dry_run else "gpu"]
    model = tiny_model(sizes[0], device, torch.float16 if cuda else torch.float32)
    reference, reference_cache = teacher_forced(model, "torch", decode_step, 4, sizes, 64)
    if cuda or args.cpu_compile == "inductor":
        step, backend = compiled_decode_step(model, device), ("inductor, CUDA graphs (reduce-overhead)" if cuda
                                                               else "inductor")
    else:
        step, backend = torch.compile(decode_step, fullgraph=True, backend="aot_eager"), "aot_eager (no Inductor)"
    began = time.perf_counter()
    ours, cache = teacher_forced(model, "auto", step, 4, sizes, 64)
    row = compare(ours, reference, cache, reference_cache, 2e-2 if cuda else 1e-4)
    figure(bits=4, steps=64, device=device.type, backend=backend, seconds_with_compile=time.perf_counter() - began,
           **row)
    return row["ok"]


def peak_bytes(run, device) -> tuple[int, str]:
    """Peak bytes allocated while ``run()`` runs: CUDA's ``max_memory_allocated`` (everything held, the weights
    included); on a CPU the running total of torch's allocations in the profiler's memory events (only what the
    run allocates: the caller adds the weights)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated"
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    total = peak = 0
    for event in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                        key=lambda e: e.start_ns()):
        total += event.nbytes()
        peak = max(peak, total)
    return peak, "profiler memory events (torch's CPU allocations) + weights"


def section_memory(args) -> bool:
    """Section 6: prefill (one sequence, replicated to the batch) and decode at one cell, uncompressed
    ``StaticCache`` and ours h2o 0.2 int4: measured peak against the planner's weights + cache + workspace."""
    from types import SimpleNamespace

    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_throughput as bench
    from h2o_compress.planner.known_models import resolve_model
    from h2o_compress.runtime.compiled import decode_step
    from h2o_compress.runtime.decode_loop import greedy, run_steps
    from h2o_compress.runtime.prefill import prefill_replicated

    cuda = torch.cuda.is_available()
    device, dtype = torch.device("cuda" if cuda else "cpu"), torch.float16 if cuda else torch.float32
    fields = bench.TINY if args.dry_run else {**bench.LLAMA_7B, "num_hidden_layers": 8}
    context, batch = (192, 4) if args.dry_run else (4096, 16)
    plan = SimpleNamespace(warmup=0, steps=4 if args.dry_run else 32, instrument_steps=0,
                           chunk=64 if args.dry_run else 2048, prefill="replicate")
    model = bench.build_model(fields, dtype, device)
    spec, weights = resolve_model(model), sum(p.numel() * p.element_size() for p in model.parameters())
    for setting in (s for s in bench.SETTINGS if s.key in ("sdpa-static", "h2o0.2-4")):
        cache_bytes, work, _ = bench.estimate(spec, setting, batch, context, plan, dtype)

        @torch.inference_mode()
        def run():
            cache = bench.new_cache(model, setting, context + plan.steps + 1)
            ids = torch.randint(100, fields["vocab_size"] - 100, (1, context), generator=torch.Generator()
                                .manual_seed(context)).to(device)
            token = greedy(prefill_replicated(model, ids, cache, batch, plan.chunk))
            run_steps(decode_step, model, cache, token, context, plan.steps)

        peak, how = peak_bytes(run, device)
        measured = peak if cuda else peak + weights
        planned = weights + cache_bytes + work
        figure(setting=setting.key, context=context, batch=batch, layers=fields["num_hidden_layers"],
               planned_bytes=planned, planned_cache_bytes=cache_bytes, planned_workspace_bytes=work,
               weight_bytes=weights, peak_bytes=measured, measured_over_planned=measured / planned, how=how)
    return True


def figure(**row) -> None:
    """Print one figure row for the parent to read back (``FIGURE {json}``)."""
    print("FIGURE " + json.dumps(row), flush=True)


SECTIONS = {"triton": section_triton, "compiled": section_compiled, "memory": section_memory}


def run_section(args) -> None:
    """One of this script's own sections, in this (child) process: exit 1 where a comparison is out of tolerance."""
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # a shared CPU: more threads are slower at these sizes
    sys.exit(0 if SECTIONS[args.section](args) else 1)


def parse_args() -> argparse.Namespace:
    """The command line (``--smoke`` is another name of ``--dry-run``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-check-out")))
    parser.add_argument("--budget-minutes", type=float, default=BUDGET_MINUTES,
                        help="the whole check's wall-clock budget")
    parser.add_argument("--wheels", default=None, help="a folder of wheels to put first on the path (--prepare's)")
    parser.add_argument("--dry-run", "--smoke", dest="dry_run", action="store_true",
                        help="every section on the CPU at tiny sizes: a check of this script (CI)")
    parser.add_argument("--cpu-compile", choices=["aot_eager", "inductor"], default="aot_eager",
                        help="the compiled-vs-eager section's backend on a CPU (Inductor: a slow cold compile)")
    parser.add_argument("--only", default=None, help="comma-separated step names to run (default: all)")
    parser.add_argument("--prepare", action="store_true", help="download the device image's missing wheels, exit")
    parser.add_argument("--section", choices=sorted(SECTIONS), default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.section:
        return run_section(args)
    if args.prepare:
        return prepare(ROOT / ".whl")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_minutes * 60
    env = environment(args)
    steps = [s for s in steps_for(args) if args.only is None or s.name in args.only.split(",")]
    header = {"command": " ".join(["python", *sys.argv]), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "machine": f"{platform.node()} {platform.processor() or platform.machine()}", "dry_run": args.dry_run,
              "budget_minutes": args.budget_minutes}
    write(args.out, steps, header)
    for step in steps:
        print(f"== ({step.section}) {step.name}: {step.what}", flush=True)
        run_step(step, env, deadline, args.out)
        print(f"   {step.status} in {step.seconds} s, {len(step.figures)} figure rows", flush=True)
        write(args.out, steps, header)


if __name__ == "__main__":
    main()

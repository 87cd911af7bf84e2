"""The project's one prepared GPU check: everything a lent H100/H200 should measure, in priority order, inside about
8 minutes, writing its results as it goes (a run cut short still reports what it finished).

    # here, once (no GPU needed): wheels the device image lacks, into .whl/ (ignored by git)
    python benchmarks/gpu_check.py --prepare
    # on the GPU machine (the device tool's `run`, carry [".whl"]):
    python3 benchmarks/gpu_check.py --wheels .whl --out $OUT
    # on a CPU, to check the script itself (tiny sizes, Triton's interpreter; seconds per step):
    python benchmarks/gpu_check.py --smoke --out /tmp/gpu-check

Steps, each a subprocess under its own time limit, each skipped (and recorded so) once the total budget would be
exceeded:

1. ``environment``: the device, torch, Triton, transformers, the package's import.
2. ``cuda-tests``: ``pytest -m cuda`` over the CUDA tests and the Triton decode kernels against the torch form
   (``tests/test_cuda.py``, ``tests/attention/test_slot_attention.py``, ``tests/attention/test_triton_layer.py``),
   but those of step 3.
3. ``compiled-vs-eager``: the compiled decode step (one CUDA graph) against the eager torch form over 64 steps,
   logits and kept tokens compared, and compiled against eager perplexity (the CUDA tests named so).
4. ``decode-speed``: decode tokens/s at 4k and 16k context, batch 16, ours ``h2o 0.2 int4`` (eager and compiled)
   against transformers' ``StaticCache`` + ``torch.compile``, in one run (``gpu_throughput.py``, LLaMA-7B shape,
   8 layers, random weights), with each run's peak memory beside the planner's figure.
5. ``max-batch``: the largest batch at the card's memory, ours against the uncompressed cache, 16k context.

Output, in ``--out``: ``gpu_check.json`` and ``gpu_check.md`` (rewritten after every step: status, seconds, the
command, the tail of its output), and the files ``gpu_throughput.py`` writes (``gpu_check_speed.*``,
``gpu_check_maxbatch.*``): at most 8 files, as the device tool brings back.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Packages the device image lacks or holds at another version (the image's transformers is older than the pin).
WHEELS = ("transformers==5.23.0", "gguf==0.19.0")
#: The CUDA tests of the compiled step: 64 steps under one CUDA graph against eager, and compiled perplexity.
COMPILED_TESTS = "64_steps or compiled_perplexity"
CUDA_TESTS = ["tests/test_cuda.py", "tests/attention/test_slot_attention.py", "tests/attention/test_triton_layer.py"]


@dataclass
class Step:
    """One step of the check: a command run under ``limit_s`` seconds."""

    name: str
    what: str
    command: list[str]
    limit_s: float
    status: str = "not run"
    seconds: float = 0.0
    output_tail: str = ""
    env: dict = field(default_factory=dict)


def steps_for(args) -> list[Step]:
    """The steps in priority order, sized for a GPU or (``--smoke``) for a check of the script on a CPU."""
    python, out = sys.executable, str(args.out)
    pytest = [python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "cuda", "-o", "addopts="]
    throughput = [python, "benchmarks/gpu_throughput.py", "--out", out]
    if args.smoke:
        throughput += ["--smoke", "--device", "cpu"]
        speed = ["--cells", "96x4,192x4", "--parts", "speed"]
        maxbatch = ["--maxbatch-contexts", "192", "--parts", "maxbatch"]
    else:
        speed = ["--layers", "8", "--cells", "4096x16,16384x16", "--parts", "speed", "--max-minutes", "2.5"]
        maxbatch = ["--layers", "8", "--maxbatch-contexts", "16384", "--parts", "maxbatch", "--max-minutes", "1"]
    settings = ["--settings", "sdpa-static+compile,h2o0.2-4,h2o0.2-4+compile"]
    return [
        Step("environment", "device, versions, the package's import", [python, "-c", ENVIRONMENT], 60),
        Step("cuda-tests", "CUDA tests; Triton kernels against the torch form",
             pytest + CUDA_TESTS + ["-k", f"not ({COMPILED_TESTS})"], 150),
        Step("compiled-vs-eager", "compiled decode (CUDA graphs) against eager: logits over 64 steps, perplexity",
             pytest + CUDA_TESTS + ["-k", COMPILED_TESTS], 120),
        Step("decode-speed", "tokens/s at 4k and 16k x 16: ours h2o 0.2 int4 vs StaticCache + compile; peak vs "
             "planner", throughput + speed + settings + ["--name", "gpu_check_speed"], 180),
        Step("max-batch", "largest batch at the card's memory, ours vs uncompressed, 16k",
             throughput + maxbatch + ["--maxbatch-settings", "sdpa-dynamic,h2o0.2-4", "--settings",
                                      "sdpa-dynamic,h2o0.2-4", "--name", "gpu_check_maxbatch"], 90),
    ]


ENVIRONMENT = """
import json, torch, transformers, h2o_compress
info = {"torch": torch.__version__, "transformers": transformers.__version__, "h2o_compress": h2o_compress.__version__,
        "cuda": torch.cuda.is_available()}
if info["cuda"]:
    props = torch.cuda.get_device_properties(0)
    info.update(device=props.name, memory_GiB=round(props.total_memory / 2**30, 1), capability=f"{props.major}.{props.minor}")
try:
    import triton
    info["triton"] = triton.__version__
except ImportError:
    info["triton"] = None
print(json.dumps(info))
"""


def run_step(step: Step, env: dict, deadline: float) -> None:
    """Run ``step`` under the smaller of its own limit and what is left of the total budget; record the outcome."""
    left = deadline - time.monotonic()
    if left < min(30.0, step.limit_s):
        step.status = "skipped: the check's time budget is spent"
        return
    started = time.monotonic()
    try:
        done = subprocess.run(step.command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=min(step.limit_s, left))
        step.status = "passed" if done.returncode == 0 else f"failed (exit {done.returncode})"
        output = done.stdout + done.stderr
    except subprocess.TimeoutExpired as stopped:
        step.status = f"stopped at its limit ({min(step.limit_s, left):.0f} s)"
        output = (stopped.stdout or b"").decode(errors="replace") + (stopped.stderr or b"").decode(errors="replace")
    step.seconds = round(time.monotonic() - started, 1)
    step.output_tail = output[-3000:]


def write(out: Path, steps: list[Step], header: dict) -> None:
    """``gpu_check.json`` and ``gpu_check.md`` as they stand."""
    (out / "gpu_check.json").write_text(json.dumps({**header, "steps": [asdict(s) for s in steps]}, indent=1))
    lines = [f"# GPU check ({header['started']})", "", f"`{header['command']}`", "",
             f"- machine: {header['machine']}", "", "| step | what | status | seconds |", "|---|---|---|---:|"]
    lines += [f"| {s.name} | {s.what} | {s.status} | {s.seconds} |" for s in steps]
    for s in steps:
        if s.output_tail:
            lines += ["", f"## {s.name}", "", "```", s.output_tail.strip()[-1500:], "```"]
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
    if args.smoke:
        env["TRITON_INTERPRET"] = "1"
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-check-out")))
    parser.add_argument("--budget-minutes", type=float, default=8.0, help="the whole check's wall-clock budget")
    parser.add_argument("--wheels", default=None, help="a folder of wheels to put first on the path (--prepare's)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: a check of this script")
    parser.add_argument("--only", default=None, help="comma-separated step names to run (default: all)")
    parser.add_argument("--prepare", action="store_true", help="download the device image's missing wheels, exit")
    args = parser.parse_args()
    if args.prepare:
        return prepare(ROOT / ".whl")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_minutes * 60
    env = environment(args)
    steps = [s for s in steps_for(args) if args.only is None or s.name in args.only.split(",")]
    header = {"command": " ".join(["python", *sys.argv]), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "machine": f"{platform.node()} {platform.processor() or platform.machine()}", "smoke": args.smoke}
    write(args.out, steps, header)
    for step in steps:
        print(f"== {step.name}: {step.what}", flush=True)
        run_step(step, env, deadline)
        print(f"   {step.status} in {step.seconds} s", flush=True)
        write(args.out, steps, header)


if __name__ == "__main__":
    main()

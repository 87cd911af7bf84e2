"""int8 weight paths on CPU end to end: today's packed kernel vs dynamic int8 activations, one process.

    python benchmarks/cpu_weight_paths.py --threads 1,2 --prompt-tokens 1000 --steps 30 --rounds 3

Loads SmolLM2-135M as ``load_model(weights_bits=16)`` (fp32, the quality reference) and three times as
``load_model(weights_bits=8)``: ``int8 packed`` as loaded (``Int8Linear``, ``_weight_int8pack_mm``, the package's
CPU default); ``dyn int8``, every ``Int8Linear`` (head included) swapped for this script's `DynInt8Linear`
(``quantized.linear_dynamic`` on the same int8 codes and scales, x86/fbgemm pack up to `X86_ROWS` rows, oneDNN pack
above); ``dyn int8, head packed``, the same with the head left ``Int8Linear``. The dynamic kernel lives here only:
it fails the 1.01x perplexity bar and a row's output depends on the other rows of the call, so the package has no
such option. Reports:

- quality: perplexity of the first ``--ppl-tokens`` tokens of each reporting text of ``--texts``, uncompressed
  cache, one forward (``reference_perplexity``, the many-row path), and each path's ratio to fp32;
- invariance: a 256-token sequence alone vs as row 0 of a batch of two (argmax agreement, max |logit diff|), and
  its last 64 positions read one token at a time after a 192-token prefill vs in the one forward (the one-row path
  against the many-row one);
- speed, per ``--threads``, the int8 paths alternating ``--rounds`` times: the package's prefill (``feed_prompt``,
  h2o 0.2 + int4 KV) of a ``--prompt-tokens`` prompt (tokens/s), then ``--steps`` greedy decode steps
  (``decode_step``), the median step's ms; medians over the rounds.

Writes ``--out`` (JSON) and the same path with ``.md``, with the command, CPU model, flags and load averages.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache

from h2o_compress import CompressionConfig, load_model, make_cache
from h2o_compress.evaluation.corpus import REPORTING_TEXTS, default_corpus, reporting_text, tokenize_text
from h2o_compress.evaluation.perplexity import reference_perplexity
from h2o_compress.models.int8_linear import ONE_THREAD_BYTES, Int8Linear, int8_layers, one_row_product
from h2o_compress.runtime.compiled import decode_one, decode_step
from h2o_compress.runtime.prefill import feed_prompt

#: Products of at most this many rows run on the ``x86`` (fbgemm) pack, more rows on the ``onednn`` pack.
X86_ROWS = 16
#: CPU flags reported with the results (``/proc/cpuinfo`` spelling).
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_int8", "amx_tile", "amx_bf16")
#: CPU flags with int8 dot-product instructions that do not saturate (``/proc/cpuinfo`` spelling).
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
#: Path -> (``load_model`` options, which ``Int8Linear`` layers become `DynInt8Linear`: none, all, all but the head).
PATHS = {"fp32": (dict(weights_bits=16), None), "int8 packed": (dict(weights_bits=8), None),
         "dyn int8": (dict(weights_bits=8), "all"), "dyn int8, head packed": (dict(weights_bits=8), "body")}
KERNEL_LINE = ("The dynamic int8 kernel (`DynInt8Linear`, swapped into a loaded `weights_bits=8` model) lives in "
               "this benchmark, not in the package: it is not a default (nor an option) because its quality fails "
               "the 1.01x bar and the rows of a batch change each other's tokens.")
CONFIG = CompressionConfig(budget=0.2, kv_bits=4)


def cpu_facts() -> dict:
    """The CPU model, core count, which flags it has, and whether it has int8 dot products (`INT8_DOT_FLAGS`)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    fields = dict(line.split(":", 1) for line in reversed(info.splitlines()) if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    present = set(fields.get("flags", "").split())
    dot = "x86" in torch.backends.quantized.supported_engines and bool(present & set(INT8_DOT_FLAGS))
    return {"model": fields.get("model name", platform.processor()), "cores": os.cpu_count(),
            "flags": [flag for flag in FLAGS if flag in present], "int8_dot_products": dot}


def _prepack(q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, engine: str):
    """``q`` ``[out, in]`` int8 with per-row fp32 ``scales`` ``[out]`` packed for quantized ``engine``."""
    with warnings.catch_warnings():  # torch marks its quantized tensors deprecated; its dynamic Linear needs one
        warnings.simplefilter("ignore", UserWarning)
        zero_points = torch.zeros_like(scales, dtype=torch.long)
        qweight = torch._make_per_channel_quantized_tensor(q, scales.double(), zero_points, 0)
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        return torch.ops.quantized.linear_prepack(qweight, bias)
    finally:
        torch.backends.quantized.engine = previous


class DynInt8Linear(nn.Module):
    """An ``Int8Linear``'s int8 weight ``[out, in]`` (per-row scales ``[out]``) run by ``quantized.linear_dynamic``:
    the activations are quantized to uint8 on each call, one scale and zero point over the whole ``[rows, in]``
    input (so a row's output depends on the other rows), int32 sums, fp32 output."""

    def __init__(self, layer: Int8Linear, int8_dot_products: bool):
        super().__init__()
        self.out_features, self.in_features = layer.weight_int8.shape
        scales = layer.scales.float()
        bias = None if layer.bias is None else layer.bias.detach().float()
        engines = [e for e in ("x86", "onednn") if e in torch.backends.quantized.supported_engines]
        self.packs = {engine: _prepack(layer.weight_int8, scales, bias, engine) for engine in engines}
        self.reduce_range = not int8_dot_products  # 7-bit activations where plain AVX2 sums would saturate
        self.one_thread = layer.weight_int8.numel() < ONE_THREAD_BYTES

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        engine = "x86" if rows.shape[0] <= X86_ROWS or "onednn" not in self.packs else "onednn"
        return torch.ops.quantized.linear_dynamic(rows, self.packs[engine], self.reduce_range)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in]`` (any float dtype) -> ``[..., out]`` in ``x``'s dtype, computed from fp32 rows."""
        rows = x.reshape(-1, self.in_features).float().contiguous()
        out = one_row_product(self.one_thread, self._product, rows)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def swap_to_dynamic(model, which: str, int8_dot_products: bool) -> int:
    """Replace ``model``'s ``Int8Linear`` layers by `DynInt8Linear` ones: ``all``, or ``body`` (the output head
    stays ``Int8Linear``). Returns how many were swapped."""
    head = model.get_output_embeddings()
    swap = {id(layer) for layer in int8_layers(model) if which == "all" or layer is not head}
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if id(child) in swap:
                setattr(module, name, DynInt8Linear(child, int8_dot_products))
                swapped += 1
    return swapped


def quality(models: dict, tokenizer, tokens: int, names: list[str]) -> dict:
    """{text: {path: perplexity, "ratio <path>": that / fp32's}} on each reporting text of ``names``."""
    texts = {name: reporting_text(name) for name in names}
    out = {}
    for name, text in texts.items():
        ids = tokenize_text(tokenizer, text, tokens)
        ppl = {path: reference_perplexity(model, ids) for path, model in models.items()}
        out[name] = {**ppl, **{f"ratio {p}": v / ppl["fp32"] for p, v in ppl.items() if p != "fp32"}}
        print(name, {k: round(v, 4) for k, v in out[name].items()}, flush=True)
    return out


def invariance(model, tokenizer) -> dict:
    """Alone vs in a batch of two, and one token at a time vs one forward (argmax agreement, max |diff|)."""
    a = tokenize_text(tokenizer, reporting_text(list(REPORTING_TEXTS)[0]), 256)
    b = tokenize_text(tokenizer, reporting_text(list(REPORTING_TEXTS)[1]), 256)
    with torch.inference_mode():
        alone = model(input_ids=a).logits[0]
        batch = model(input_ids=torch.cat([a, b])).logits[0]
        cache = DynamicCache()
        model(input_ids=a[:, :192], past_key_values=cache)
        steps = torch.cat([decode_one(decode_step, model, cache, a[:, i:i + 1], i) for i in range(192, 256)])
    whole = alone[192:]
    return {"batch_argmax_agree": (alone.argmax(-1) == batch.argmax(-1)).float().mean().item(),
            "batch_max_diff": (alone - batch).abs().max().item(),
            "steps_argmax_agree": (whole.argmax(-1) == steps.argmax(-1)).float().mean().item(),
            "steps_max_diff": (whole - steps).abs().max().item()}


def one_round(model, prompt: torch.Tensor, steps: int) -> tuple[float, float]:
    """(prefill tokens/s, median decode step ms) of one prefill + ``steps`` greedy steps."""
    with torch.inference_mode():
        cache = make_cache(model, CONFIG, max_length=prompt.shape[1] + steps + 8)
        start = time.perf_counter()
        logits = feed_prompt(model, prompt, cache)
        prefill = prompt.shape[1] / (time.perf_counter() - start)
        times, seen = [], prompt.shape[1]
        for _ in range(steps + 3):
            token = logits.argmax(-1, keepdim=True)
            start = time.perf_counter()
            logits = decode_one(decode_step, model, cache, token, seen)
            times.append(time.perf_counter() - start)
            seen += 1
    return prefill, statistics.median(times[3:]) * 1e3


def speed(models: dict, prompt: torch.Tensor, args) -> dict:
    """{threads: {path: {prefill tokens/s, step ms medians, rounds}}}, the paths alternating each round."""
    out = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for model in models.values():
            one_round(model, prompt[:, :64], 3)  # warm-up
        runs = {path: [] for path in models}
        for round_ in range(args.rounds):
            for path, model in models.items():
                runs[path].append(one_round(model, prompt, args.steps))
                print(f"{threads} threads round {round_} {path}: prefill {runs[path][-1][0]:.0f} tok/s, "
                      f"step {runs[path][-1][1]:.2f} ms", flush=True)
        out[threads] = {path: {"prefill_tokens_per_s": statistics.median(r[0] for r in rs),
                               "step_ms": statistics.median(r[1] for r in rs),
                               "rounds": [[round(v, 3) for v in r] for r in rs]} for path, rs in runs.items()}
    return out


def markdown(result: dict) -> str:
    """The results as a markdown page."""
    cpu = result["cpu"]
    paths = list(result["invariance"])
    lines = ["# int8 weight paths on CPU: packed kernel vs dynamic int8 activations (SmolLM2-135M)", "",
             f"`{result['command']}`", "",
             f"CPU: {cpu['model']}, {cpu.get('cores')} cores, flags {', '.join(cpu['flags'])}; torch "
             f"{result['torch']}; int8 dot products (VNNI/AMX, no reduce_range): {cpu['int8_dot_products']}; "
             f"load average before {result['load_before']}, after {result['load_after']}. "
             f"{result['note']}", "", KERNEL_LINE, "", f"## Perplexity, first {result['ppl_tokens']} tokens, uncompressed cache", "",
             "| text | " + " | ".join(result["paths"]) + " | " + " | ".join(f"{p} / fp32" for p in paths) + " |",
             "|---|" + "---:|" * (len(result["paths"]) + len(paths))]
    for text, row in result["quality"].items():
        lines.append(f"| {text} | " + " | ".join(f"{row[p]:.3f}" for p in result["paths"]) + " | "
                     + " | ".join(f"{row['ratio ' + p]:.4f}x" for p in paths) + " |")
    lines += ["", "## Invariance (256 tokens): alone vs in a batch of 2; one token at a time vs one forward", "",
              "| path | batch argmax agree | batch max diff | steps argmax agree | steps max diff |",
              "|---|---:|---:|---:|---:|"]
    for path, row in result["invariance"].items():
        lines.append(f"| {path} | {row['batch_argmax_agree']:.4f} | {row['batch_max_diff']:.4f} | "
                     f"{row['steps_argmax_agree']:.4f} | {row['steps_max_diff']:.4f} |")
    lines += ["", f"## Speed: {result['prompt_tokens']}-token prompt, h2o 0.2 + int4 KV, median of "
              f"{result['steps']} decode steps, {result['rounds']} alternating rounds (medians)", "",
              "| threads | path | decode step ms | decode tokens/s | prefill tokens/s | rounds (prefill tok/s, ms) |",
              "|---:|---|---:|---:|---:|---|"]
    for threads, rows in result["speed"].items():
        for path, row in rows.items():
            lines.append(f"| {threads} | {path} | {row['step_ms']:.2f} | {1e3 / row['step_ms']:.1f} | "
                         f"{row['prefill_tokens_per_s']:.0f} | {row['rounds']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ppl-tokens", type=int, default=1024)
    parser.add_argument("--out", default="benchmarks/results/cpu_weight_paths.json")
    parser.add_argument("--texts", default=",".join(REPORTING_TEXTS), help="reporting texts for the perplexity")
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    args.threads = [int(t) for t in args.threads.split(",")]
    load_before = [round(v, 2) for v in os.getloadavg()]
    torch.set_num_threads(args.threads[-1])
    models, tokenizer, cpu = {}, None, cpu_facts()
    for path, (load, which) in PATHS.items():
        models[path], tokenizer = load_model("smollm2-135m", device="cpu", **load)
        if which:
            swap_to_dynamic(models[path], which, cpu["int8_dot_products"])
    result = {"command": "python benchmarks/cpu_weight_paths.py " + shlex.join(sys.argv[1:]), "note": args.note, "kernel": KERNEL_LINE,
              "cpu": cpu, "torch": torch.__version__, "paths": list(PATHS), "ppl_tokens": args.ppl_tokens,
              "prompt_tokens": args.prompt_tokens, "steps": args.steps, "rounds": args.rounds,
              "load_before": load_before}
    result["quality"] = quality(models, tokenizer, args.ppl_tokens, args.texts.split(","))
    result["invariance"] = {p: invariance(m, tokenizer) for p, m in models.items() if p != "fp32"}
    print(result["invariance"], flush=True)
    prompt = tokenizer(default_corpus(), return_tensors="pt").input_ids[:, :args.prompt_tokens]
    result["speed"] = speed({p: m for p, m in models.items() if p != "fp32"}, prompt, args)
    result["load_after"] = [round(v, 2) for v in os.getloadavg()]
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()

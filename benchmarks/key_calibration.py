"""Keys quantized after removing a calibrated per-channel offset (issue 46, item 4), and keys and values at
different bits at equal bytes.

    python benchmarks/key_calibration.py --phase choose --threads 1   # the tuning text only: picks the variant
    python benchmarks/key_calibration.py --phase report --threads 1   # the reporting corpus, with the chosen one

The simulation of ``eviction_directions.py`` (SmolLM2 reads the text token by token; cached keys and values are
fake-quantized in place once they leave the residual window of :data:`RESIDUAL` tokens), with one more quantizer:

- ``calib int4``: KVQuant's observation (Hooper et al. 2024, arXiv 2401.18079 §3.1) that keys have a per-channel
  bias best seen before RoPE, used with the library's per-token format: the mean pre-RoPE key of each layer and KV
  head (``key_channel_mean`` of :func:`h2o_compress.calibration.key_channels.key_channel_statistics`, fitted on the
  tuning text) is rotated to each token's position (``offset_post = RoPE(pos) @ mean``), subtracted from the
  post-RoPE key, the rest quantized as ``token int4`` (Hadamard rotation, per-token groups of 32, fp16 scale and
  zero), and the offset added back after dequantizing. No bytes are added per token (one vector per head). The
  first :data:`SINKS` positions (the attention sink, whose key is far from the mean: subtracting it widens the
  sink's range 2-4x in most layers) are quantized without it.
- ``calib-auto int4``: the offset on each token only where it narrows that token's widest rotated group (one flag
  per token; it could ride in the sign bit of the always-positive fp16 scale).
- ``calib-scale^a int4``: also divided, before quantizing, by ``key_channel_scale ** a`` made rotation-invariant
  (the RMS of each RoPE pair's two channels, so it commutes with RoPE), multiplied back after.
- ``kKvV``: keys at K bits and values at V bits (per-token groups of 32, Hadamard, fp16 scale and zero) with
  K + V = 8: the same bytes as 4 + 4. ``calib kKvV``: the same with the calibrated offset on the keys.

``--library`` adds the library's own cache with the chosen variant (``library calib-auto int4``: ``make_cache`` then
``h2o_compress.calibration.key_channels.use_key_calibration``, read by ``read_stream`` one token at a time; budget
1.0 and ``--budget`` with ``h2o``), ``--only-library`` those rows alone.

The calibration text is the tuning text (``sherlock``), tokens :data:`CALIBRATION_SLICE`: outside the 1,024 tokens
scored in the choose phase, so the tuning figure is not fitted on the tokens it scores. Every choice (variant,
exponent, bits) is made in the choose phase on the tuning text; the report phase only reports, with it.
Writes JSON (every row, with its command) and the same path with ``.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.models.llama.modeling_llama import rotate_half

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eviction_directions import (GROUP, RESIDUAL, Direction, Simulation, fake_quantize, ratio_table,  # noqa: E402
                                 simulate)

from h2o_compress import CompressionConfig, load_model, make_cache  # noqa: E402
from h2o_compress.calibration.key_channels import key_channel_statistics  # noqa: E402
from h2o_compress.evaluation.corpus import REPORTING_TEXTS, load_text, tokenize_text  # noqa: E402
from h2o_compress.calibration.key_channels import use_key_calibration  # noqa: E402
from h2o_compress.evaluation.perplexity import NLLAccumulator, streaming_perplexity  # noqa: E402
from h2o_compress.evaluation.stream import read_stream  # noqa: E402
from h2o_compress.formats.integer import hadamard_matrix  # noqa: E402

CALIBRATION_SLICE = (1024, 3072)  # tuning-text tokens the statistics are fitted on
#: choose-phase variants at budget 1.0: name -> (offset, scale exponent or None, key bits, value bits)
SINKS = 1  # leading positions (attention sinks) quantized without the offset and scale
#: choose-phase variants at budget 1.0: name -> (offset: "sinks" | "auto" | None, scale exponent, key bits,
#: value bits)
VARIANTS = {"calib int4": ("sinks", None, 4, 4), "calib-auto int4": ("auto", None, 4, 4),
            "calib-scale^0.5 int4": ("sinks", 0.5, 4, 4), "k5v3": (None, None, 5, 3),
            "calib k5v3": ("sinks", None, 5, 3)}
BASELINES = {"token int4": Direction("token int4", rank="full", quant="token"),
             "kivi int4": Direction("kivi int4", rank="full", quant="kivi")}


def per_token_bits(x: torch.Tensor, rotation: torch.Tensor, bits: int) -> torch.Tensor:
    """``x [..., tokens, head_dim]`` rotated, quantized per token in groups of :data:`GROUP` at ``bits``, rotated
    back."""
    y = x @ rotation
    shape = y.shape
    y = fake_quantize(y.reshape(*shape[:-1], shape[-1] // GROUP, GROUP), -1, bits).reshape(shape)
    return y @ rotation.T


def group_range(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """``[..., tokens, 1]``: the widest range (max - min) among each token's rotated groups."""
    y = (x @ rotation).unflatten(-1, (-1, GROUP))
    return (y.amax(-1) - y.amin(-1)).amax(-1, keepdim=True)


class CalibratedSimulation(Simulation):
    """:class:`Simulation` with ``quant="calib"``: options ``offset`` (post-RoPE, fp32 ``[layers, kv_heads,
    tokens, head_dim]`` or None), ``scale`` (fp32 ``[layers, kv_heads, 1, head_dim]`` or None), ``key_bits``,
    ``value_bits``."""

    def __init__(self, direction: Direction, layers, kv_heads, tokens, capacity, recent, head_dim):
        super().__init__(direction, layers, kv_heads, tokens, capacity, recent, head_dim)
        self.rotation = hadamard_matrix(head_dim)

    def quantize(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.d.quant != "calib":
            return super().quantize(layer, keys, values)
        o = self.d.options
        done, upto = int(self.quantized[layer]), keys.shape[1] - RESIDUAL
        if upto <= done:
            return
        k = keys[:, done:upto].float()
        offset = o["offset"][layer, :, done:upto] if o["offset"] is not None else torch.zeros_like(k)
        scale = o["scale"][layer, :, done:upto] if o["scale"] is not None else torch.ones_like(k)
        if o.get("auto"):  # the offset only where it narrows the token's widest group (a flag per token)
            offset = torch.where(group_range(k - offset, self.rotation) < group_range(k, self.rotation),
                                 offset, torch.zeros_like(offset))
        quantized = per_token_bits((k - offset) / scale, self.rotation, o["key_bits"]) * scale + offset
        keys[:, done:upto] = quantized.to(keys.dtype)
        values[:, done:upto] = per_token_bits(values[:, done:upto].float(), self.value_rotation,
                                              o["value_bits"]).to(values.dtype)
        self.quantized[layer] = upto


def calibration(model, tokenizer, tokens: int) -> dict[str, torch.Tensor]:
    """Statistics on the tuning text's :data:`CALIBRATION_SLICE`, and ``offset`` (``RoPE(pos) @ mean`` for
    positions ``0..tokens-1``, ``[layers, kv_heads, tokens, head_dim]``) and ``pair_scale`` (each RoPE pair's RMS
    scale, ``[layers, kv_heads, 1, head_dim]``)."""
    start, stop = CALIBRATION_SLICE
    ids = tokenize_text(tokenizer, load_text(None), stop)[:, start:stop]
    stats = key_channel_statistics(model, ids)
    mean, scale = stats["key_channel_mean"], stats["key_channel_scale"]
    positions = torch.arange(tokens).unsqueeze(0)
    cos, sin = model.model.rotary_emb(mean[:1, :1], positions)  # [1, tokens, head_dim]
    offset = mean.unsqueeze(2) * cos.float() + rotate_half(mean).unsqueeze(2) * sin.float()
    half = scale.shape[-1] // 2
    pair = ((scale[..., :half] ** 2 + scale[..., half:] ** 2) / 2).sqrt()
    pair = torch.cat((pair, pair), -1).unsqueeze(2).repeat(1, 1, tokens, 1)
    exempt = offset.clone()
    exempt[:, :, :SINKS] = 0
    pair[:, :, :SINKS] = 1
    return {**stats, "offset": offset, "offset_sinks": exempt, "pair_scale": pair}


def variant(name: str, budget: float, calib: dict) -> Direction:
    """The :data:`VARIANTS` entry ``name`` as a direction (``h2o`` eviction below budget 1.0)."""
    use_offset, exponent, key_bits, value_bits = VARIANTS[name]
    offset = {"sinks": calib["offset_sinks"], "auto": calib["offset"], None: None}[use_offset]
    options = {"offset": offset, "auto": use_offset == "auto",
               "scale": calib["pair_scale"] ** exponent if exponent is not None else None,
               "key_bits": key_bits, "value_bits": value_bits}
    rank = "full" if budget >= 1.0 else "h2o"
    return Direction(name if rank == "full" else f"h2o {name}", rank=rank, quant="calib", options=options)


def baseline(name: str, budget: float) -> Direction:
    d = BASELINES[name]
    return d if budget >= 1.0 else Direction(f"h2o {name}", quant=d.quant)


@dataclass
class Library:
    """A library row: ``config``'s cache, its keys stored around the calibration (``use_key_calibration``)."""

    config: CompressionConfig


@torch.inference_mode()
def library_perplexity(model, ids: torch.Tensor, config: CompressionConfig, calib: dict) -> float:
    """Perplexity of ``ids`` read token by token through the library's cache with the key calibration."""
    cache = make_cache(model, config, max_length=ids.shape[1])
    use_key_calibration(cache, model, calib)
    scorer = NLLAccumulator(ids)
    read_stream(model, cache, ids, 1, on_logits=scorer)
    return math.exp(scorer.mean)


def library_rows(budget: float) -> list[tuple]:
    """The library's ``calib-auto int4`` and its plain int4 (no calibration) at budget 1.0 and ``budget`` (``h2o``,
    no capacity floor, as the simulated rows)."""
    rows = []
    for b in (1.0, budget):
        config, name = CompressionConfig(budget=b, kv_bits=4, min_capacity=0), "library " + ("" if b >= 1.0 else "h2o ")
        rows += [(b, name + "calib-auto int4", Library(config)), (b, name + "int4", config)]
    return rows


def plan(budget: float, names: list[str], calib: dict) -> list[tuple]:
    """``(budget, row, setting)``: the two baselines and the :data:`VARIANTS` ``names`` at ``budget``."""
    settings = [baseline(b, budget) for b in BASELINES] + [variant(n, budget, calib) for n in names]
    return [(budget, d.name, d) for d in settings]


def run(model, ids, text: str, todo: list[tuple], rows: list[dict], out: Path, command: str, calib: dict) -> None:
    """Each ``(budget, row, setting)`` of ``todo`` not yet in ``rows`` (matched by text, budget and row), measured
    and appended; ``out`` rewritten after each. The uncompressed model (``library full``) is measured first."""
    todo = [(1.0, "library full", CompressionConfig(policy="full")), *todo]
    for budget, name, setting in todo:
        if any((r["text"], r["budget"], r["row"]) == (text, budget, name) for r in rows):
            continue
        reference = next((r["perplexity"] for r in rows if (r["text"], r["row"]) == (text, "library full")), None)
        started, capacity = time.perf_counter(), None
        if isinstance(setting, CompressionConfig):
            ppl = streaming_perplexity(model, ids, setting, 1).perplexity
        elif isinstance(setting, Library):
            ppl = library_perplexity(model, ids, setting.config, calib)
        else:
            cache = make_cache(model, CompressionConfig(budget=budget, min_capacity=0), max_length=ids.shape[1])
            capacity = cache.capacity or ids.shape[1]
            ppl = simulate(model, ids, setting, capacity, cache.layers[0].setting.policy.recent_window(capacity),
                           CalibratedSimulation)
        row = {"text": text, "budget": budget, "row": name, "perplexity": ppl, "ratio": ppl / (reference or ppl),
               "capacity": capacity, "seconds": round(time.perf_counter() - started, 1), "command": command}
        rows.append(row)
        print(json.dumps(row), flush=True)
        out.write_text(json.dumps({"rows": rows}, indent=1))


def choose(rows: list[dict]) -> str:
    """The variant with the lowest ratio at budget 1.0 on the tuning text (ties: the first in :data:`VARIANTS`)."""
    ratios = {r["row"]: r["ratio"] for r in rows if r["budget"] == 1.0 and r["row"] in VARIANTS}
    return min(VARIANTS, key=lambda n: ratios.get(n, float("inf")))


def arguments() -> tuple[argparse.Namespace, list[str]]:
    """The command line, and the texts to read (checked before any model loads)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase", choices=("choose", "report"), required=True)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--budget", type=float, default=0.2, help="the eviction budget (h2o) besides 1.0")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--texts", default="", help="report phase: a subset of the reporting texts")
    parser.add_argument("--chosen", default="benchmarks/results/key_calibration_choose.json")
    parser.add_argument("--out", default=None)
    parser.add_argument("--library", action="store_true",
                        help="also the library's cache with the calibration (use_key_calibration; calib-auto int4)")
    parser.add_argument("--only-library", action="store_true", help="the library rows alone")
    args = parser.parse_args()
    if args.phase == "choose":
        return args, ["sherlock"]  # the tuning text (TUNING_TEXT) by its name
    texts = [t for t in (args.texts.split(",") if args.texts else REPORTING_TEXTS) if t]
    if any(t not in REPORTING_TEXTS for t in texts):
        parser.error(f"--texts {texts}: the report phase reads only the reporting corpus {list(REPORTING_TEXTS)}")
    return args, texts


def main() -> None:
    args, texts = arguments()
    torch.set_num_threads(args.threads)
    default = ("benchmarks/results/key_calibration_choose.json" if args.phase == "choose" else
               f"benchmarks/results/reporting_corpus/key_calibration_{args.tokens}.json")
    out = Path(args.out or default)
    command = "python benchmarks/key_calibration.py " + shlex.join(sys.argv[1:])
    model, tokenizer = load_model("smollm2-135m", device="cpu")
    calib = calibration(model, tokenizer, args.tokens)
    rows = json.loads(out.read_text())["rows"] if out.exists() else []
    if args.phase == "choose":
        ids = tokenize_text(tokenizer, load_text(None), args.tokens)
        run(model, ids, "sherlock", plan(1.0, list(VARIANTS), calib), rows, out, command, calib)
        chosen = choose(rows)
        names = list(dict.fromkeys(["calib int4", chosen]))
        todo = plan(args.budget, names, calib) + (library_rows(args.budget) if args.library else [])
        run(model, ids, "sherlock", todo, rows, out, command, calib)
    else:
        chosen = json.loads(Path(args.chosen).read_text())["chosen"]
        for text in texts:
            ids = tokenize_text(tokenizer, load_text(text), args.tokens)
            todo = [] if args.only_library else plan(1.0, [chosen], calib) + plan(args.budget, [chosen], calib)
            todo += library_rows(args.budget) if args.library or args.only_library else []
            run(model, ids, text, todo, rows, out, command, calib)
    result = {"rows": rows, "chosen": chosen, "calibration": f"sherlock tokens {CALIBRATION_SLICE}"}
    out.write_text(json.dumps(result, indent=1))
    write_markdown(result, out.with_suffix(".md"), args.phase)


LIBRARY_NOTE = (
    "Rows named `library ...` are the library's cache; the others the simulation. The library without the "
    "calibration, from `benchmarks/results/reporting_corpus/streaming_1024.md` (`python benchmarks/streaming_quality.py "
    "--texts T --tokens 1024 --threads 1 --settings budget=1.0,kv_bits=4`, and `budget=0.2,kv_bits=4`): 1.036x / "
    "1.004x / 1.014x at budget 1.0 and 1.120x / 1.042x / 1.051x at 0.2 (python_reference / persuasion / python_code; "
    "its capacity floor, 192, is below 0.2 x 1,024 tokens, so the capacity is the same).")


def write_markdown(result: dict, path: Path, phase: str) -> None:
    """One row per (budget, row), one column per text; each row's command below the table."""
    rows = result["rows"]
    lines = [f"# Calibrated key offsets and mixed K/V bits, streaming perplexity x uncompressed ({phase} phase)", "",
             "SmolLM2-135M, token by token, the simulation of `benchmarks/key_calibration.py`. Calibration: the "
             f"tuning text ({result['calibration']}); every choice is made on the tuning text (choose phase) only.",
             "", *ratio_table(rows)]
    lines += ["", f"Chosen on the tuning text (lowest ratio at budget 1.0): `{result['chosen']}`"]
    if phase == "report":
        lines += ["", LIBRARY_NOTE]
    lines += ["", "Commands:", ""]
    lines += [f"    {c}" for c in dict.fromkeys(r["command"] for r in rows)]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

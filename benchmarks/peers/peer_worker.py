"""Peer side of benchmarks/compare_peers.py: kvpress presses and transformers' QuantizedCache / DynamicCache.

Runs inside ``benchmarks/peers/.venv`` (transformers 5.2, kvpress, optimum-quanto, hqq); never imports
h2o_compress and never tokenizes: every input arrives as token ids made by the main environment's tokenizer
(DESIGN.md pitfall 9). Commands arrive as JSON lines (see ``common.py``).

Long-context QA goes through kvpress's ``KVPressTextGenerationPipeline`` (the class registered as
``kv-press-text-generation``), entered at ``forward()`` with our token ids instead of text; its ``preprocess``
(chat template + tokenization) is the only stage skipped. Two instance-level additions, both measurements:
``generate_answer`` is wrapped to (1) score the reference answer teacher-forced on the same compressed cache
and (2) record the bytes the cache holds while answering; the cache's layer state is restored after each
question (kvpress's ``_remove_answer_from_cache`` does not trim a QuantizedCache's full-precision residual,
whose question/answer tokens would otherwise leak into the next question).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as metadata
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import (  # noqa: E402
    PeakRSS, answer_nll, decode_timing, ids_tensor, kept_tokens, load_inputs, log, make_probe, perplexity, serve,
    set_threads, stream_nll_chunks, transformers_cache_bytes,
)

STATE: dict = {}
EAGER_PRESSES = {"ObservedAttentionPress"}  # needs the attention weights: attn_implementation="eager"


def _load_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    except Exception as first:  # a config written by a newer transformers: retry with a cleaned copy
        log("loading the converted model failed, retrying with a cleaned config:", repr(first))
        import json

        clean = Path(tempfile.mkdtemp(prefix="peer-model-"))
        config = json.loads((Path(model_dir) / "config.json").read_text())
        for key in ("transformers_version", "_model_name_or_path"):
            config.pop(key, None)
        if "rope_parameters" in config and "rope_theta" not in config:
            config["rope_theta"] = config["rope_parameters"].get("rope_theta", 10000.0)
        (clean / "config.json").write_text(json.dumps(config))
        os.symlink(Path(model_dir) / "model.safetensors", clean / "model.safetensors")
        try:
            return AutoModelForCausalLM.from_pretrained(clean, dtype=torch.float32)
        finally:
            shutil.rmtree(clean, ignore_errors=True)


class _IdsTokenizer:
    """Stands in for the tokenizer inside kvpress's pipeline: ``decode`` returns the generated ids as text."""

    model_max_length = 10**9
    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return ",".join(str(int(i)) for i in ids)


def cmd_load(command: dict) -> dict:
    set_threads(command["threads"])
    began = time.perf_counter()
    model = _load_model(command["model_dir"])
    model.eval()
    from kvpress import KVPressTextGenerationPipeline

    STATE["model"] = model
    STATE["pipe"] = KVPressTextGenerationPipeline(model=model, tokenizer=_IdsTokenizer())
    with torch.inference_mode():  # warm-up, incl. quanto's first quantization
        ids = torch.arange(100, 164).unsqueeze(0)
        for kind in ("dynamic", "quanto4", "hqq4"):
            try:
                model(input_ids=ids, past_key_values=make_cache(kind))
            except Exception as exc:
                log("warm-up failed for", kind, repr(exc))
    versions = {}
    for name in ("transformers", "torch", "kvpress", "optimum-quanto", "hqq"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {"versions": versions, "load_s": time.perf_counter() - began, "threads": torch.get_num_threads(),
            "python": sys.version.split()[0]}


def make_cache(kind: str):
    from transformers import DynamicCache, QuantizedCache

    config = STATE["model"].config
    if kind == "dynamic":
        return DynamicCache()
    if kind == "quanto4":  # transformers' defaults: per-channel (axis 0), group 64, 128-token residual
        return QuantizedCache("quanto", config, nbits=4)
    if kind == "hqq4":  # transformers' defaults (axis 0, group 64, 128-token residual); axis 1 fails on odd
        return QuantizedCache("hqq", config, nbits=4)  # token counts (see benchmarks/README.md)
    raise ValueError(f"unknown cache kind {kind!r}")


def make_press(name: str | None, ratio: float | None):
    if not name:
        return None
    import kvpress

    if name == "AdaKVPress":  # head-adaptive budgets over a scorer (kvpress's leaderboard: AdaKV-ExpectedAttention)
        return kvpress.AdaKVPress(press=kvpress.ExpectedAttentionPress(compression_ratio=ratio))
    return getattr(kvpress, name)(compression_ratio=ratio)


def use_attention(press_name: str | None) -> None:
    wanted = "eager" if press_name in EAGER_PRESSES else "sdpa"
    model = STATE["model"]
    if model.config._attn_implementation != wanted:
        model.set_attn_implementation(wanted)


@torch.inference_mode()
def cmd_sanity(command: dict) -> dict:
    use_attention(None)
    from transformers import DynamicCache

    model = STATE["model"]
    ids = ids_tensor(command["ids"])
    logits = model(input_ids=ids, past_key_values=DynamicCache()).logits[0]
    ours = torch.load(command["ours_logits"])
    return {"tokens": ids.shape[1], "max_abs_logit_diff": (logits - ours).abs().max().item(),
            "argmax_agreement": (logits.argmax(-1) == ours.argmax(-1)).float().mean().item()}


def _layer_state(cache):
    return [dict(vars(layer)) for layer in cache.layers]


def _restore(cache, state) -> None:
    for layer, saved in zip(cache.layers, state):
        layer.__dict__.clear()
        layer.__dict__.update(saved)


@torch.inference_mode()
def cmd_needle(command: dict) -> dict:
    """Every method x item: kvpress pipeline forward on ids; greedy answer ids, teacher-forced answer NLL, bytes."""
    pipe = STATE["pipe"]
    model = STATE["model"]
    inputs = load_inputs(command["inputs"])
    max_new = command["max_new_tokens"]
    results = []
    for method in command["methods"]:
        use_attention(method.get("press"))
        for item_index, item in enumerate(inputs["needle"]):
            began = time.perf_counter()
            record = {"method": method["name"], "item": item_index, "questions": []}
            try:
                cache = make_cache(method["cache"])
                press = make_press(method.get("press"), method.get("ratio"))
                answers_ids = [q["answer_ids"] for q in item["questions"]]
                original = type(pipe).generate_answer
                calls = {"n": 0}

                def generate_answer(question_ids, cache, context_length, max_new_tokens, _orig=original):
                    index = calls["n"]
                    calls["n"] += 1
                    if index == 0:
                        record["context_kept_tokens"] = kept_tokens(cache)
                        record["context_kv_bytes"] = transformers_cache_bytes(cache)
                    state = _layer_state(cache)
                    answer = answers_ids[index]
                    forced = torch.cat([question_ids, torch.tensor([answer[:-1]], device=question_ids.device)], dim=1)
                    positions = torch.arange(context_length, context_length + forced.shape[1]).unsqueeze(0)
                    logits = model(input_ids=forced, past_key_values=cache, position_ids=positions).logits
                    nll = answer_nll(logits, answer)
                    _restore(cache, state)
                    text = _orig(pipe, question_ids, cache, context_length, max_new_tokens)
                    record["questions"].append({
                        "answer_ids": [int(t) for t in text.split(",") if t], "answer_nll": nll,
                        "kv_bytes": transformers_cache_bytes(cache), "kept_tokens": kept_tokens(cache),
                    })
                    _restore(cache, state)
                    return text

                pipe.generate_answer = generate_answer
                pipe._remove_answer_from_cache = lambda cache, lengths: None  # state restored above
                try:
                    pipe.forward({"context_ids": ids_tensor(item["context_ids"]),
                                  "questions_ids": [ids_tensor(q["ids"]) for q in item["questions"]]},
                                 press=press, max_new_tokens=max_new, cache=cache)
                finally:
                    del pipe.generate_answer
                    del pipe._remove_answer_from_cache
            except Exception as exc:
                record["error"] = f"{type(exc).__name__}: {exc}"
                log("needle", method["name"], "failed:", record["error"])
            record["seconds"] = time.perf_counter() - began
            results.append(record)
            log("needle", method["name"], item_index, f"{record['seconds']:.1f}s")
    return {"results": results}


@torch.inference_mode()
def cmd_ppl(command: dict) -> dict:
    """Streaming perplexity: the text is read ``chunk`` tokens per forward pass. QuantizedCache/DynamicCache
    stream natively; kvpress streams through ``DecodingPress(base_press, compression_interval=1, target_size)``
    (compress back to ``target`` tokens after every chunk, like our eviction)."""
    model = STATE["model"]
    inputs = load_inputs(command["inputs"])
    ids, chunk = inputs["ppl_ids"], command["chunk"]
    results = []
    for method in command["methods"]:
        press_name = method.get("press")
        use_attention(press_name)
        record = {"method": method["name"]}
        began = time.perf_counter()
        try:
            cache = make_cache(method["cache"])
            context = contextlib.nullcontext()
            if press_name:
                import kvpress

                base = getattr(kvpress, press_name)()
                press = kvpress.DecodingPress(base_press=base, compression_interval=1, target_size=method["target"])
                context = press(model)

            def step(piece, start):
                positions = torch.arange(start, start + piece.shape[1]).unsqueeze(0)
                return model(input_ids=piece, past_key_values=cache, position_ids=positions).logits

            with context:
                nll, seconds = stream_nll_chunks(step, ids, chunk)
            record.update(nll=nll, perplexity=perplexity(nll), seconds=seconds,
                          kv_bytes=transformers_cache_bytes(cache), kept_tokens=kept_tokens(cache))
        except Exception as exc:
            record["error"] = f"{type(exc).__name__}: {exc}"
            log("ppl", method["name"], "failed:", record["error"])
        record["wall_s"] = time.perf_counter() - began
        results.append(record)
        log("ppl", method["name"], f"{record['wall_s']:.1f}s")
    return {"results": results}


@torch.inference_mode()
def cmd_speed(command: dict) -> dict:
    """Prefill ``length`` tokens (compressed by the press, if any), then ``steps`` greedy decode steps."""
    model = STATE["model"]
    method = command["method"]
    press_name = method.get("press")
    use_attention(press_name)
    ids = ids_tensor(load_inputs(command["inputs"])["speed_ids"][str(command["length"])])
    length = ids.shape[1]
    record = {"method": method["name"], "length": length}
    try:
        with PeakRSS() as memory:
            cache = make_cache(method["cache"])
            press = make_press(press_name, method.get("ratio"))
            began = time.perf_counter()
            with press(model) if press is not None else contextlib.nullcontext():
                logits = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits
            record["prefill_s"] = time.perf_counter() - began
            memory.mark()

            def step(token, i):
                positions = torch.tensor([[length + i]])
                return model(input_ids=token, past_key_values=cache, position_ids=positions).logits

            record.update(decode_timing(step, logits, command["steps"], make_probe(model)))
        record.update(kv_bytes=transformers_cache_bytes(cache), kept_tokens=kept_tokens(cache),
                      peak_prefill_mib=memory.phases[0] / 2**20, peak_decode_mib=memory.phases[1] / 2**20)
    except Exception as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
        log("speed", method["name"], "failed:", record["error"])
    return record


def main() -> None:
    argparse.ArgumentParser(description=__doc__).parse_args()
    serve({"load": cmd_load, "sanity": cmd_sanity, "needle": cmd_needle, "ppl": cmd_ppl, "speed": cmd_speed})


if __name__ == "__main__":
    main()

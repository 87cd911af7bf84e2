"""Our side of benchmarks/compare_peers.py: h2o-compress's CompressedCache (and the plain DynamicCache of the
main environment), driven by the same JSON-line commands and the same token ids as ``peer_worker.py``.

The QA protocol is compress-then-ask as :mod:`h2o_compress.runtime.ask` runs it, and mirrors kvpress's pipeline: the
context is read in one forward pass (our cache evicts it to ``int(keep x context)`` tokens right after its
attention; ``kvzip`` scores it first by reconstruction), then each question is answered greedily from a frozen
copy of that compressed cache (:meth:`CompressedCache.frozen_copy`: the question and answer are added, nothing
more is evicted; kvpress removes the question and answer from its cache after each question).
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata as metadata
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import (  # noqa: E402
    PeakRSS, answer_nll, decode_timing, ids_tensor, make_probe, load_inputs, log, perplexity, serve, set_threads,
    stream_nll_chunks, transformers_cache_bytes,
)

STATE: dict = {}


def cmd_load(command: dict) -> dict:
    set_threads(command["threads"])
    from h2o_compress import load_model

    began = time.perf_counter()
    model, tokenizer = load_model(command["model"], device="cpu")
    model.eval()
    STATE["model"], STATE["tokenizer"] = model, tokenizer
    STATE["eos"] = _eos_ids(model)
    with torch.inference_mode():  # warm-up
        ids = torch.arange(100, 164).unsqueeze(0)
        model(input_ids=ids, past_key_values=_cache({"kind": "ours", "policy": "h2o", "budget": 32, "kv_bits": 4}, 64))
    versions = {name: metadata.version(name) for name in ("transformers", "torch", "h2o-compress")}
    return {"versions": versions, "load_s": time.perf_counter() - began, "threads": torch.get_num_threads(),
            "python": sys.version.split()[0]}


def _eos_ids(model) -> set[int]:
    value = model.generation_config.eos_token_id
    return set(value if isinstance(value, (list, tuple)) else [value])


def _config(method: dict, budget):
    from h2o_compress import CompressionConfig

    if method["policy"] == "full":
        return CompressionConfig(policy="full", kv_bits=method["kv_bits"])
    extra = {key: method[key] for key in ("heavy_ratio", "layer_budgets", "head_budgets", "sink_tokens",
                                          "high_bits_fraction", "evict_chat_header")
             if key in method}
    return CompressionConfig(policy=method["policy"], budget=budget, kv_bits=method["kv_bits"], **extra)


def _cache(method: dict, max_length: int, budget=None):
    """A DynamicCache (plain SDPA) or our cache; ``budget`` overrides the method's own budget."""
    from transformers import DynamicCache

    model = STATE["model"]
    if method["kind"] == "dynamic":
        if model.config._attn_implementation != "sdpa":
            model.set_attn_implementation("sdpa")
        return DynamicCache(config=model.config)
    from h2o_compress import make_cache

    return make_cache(model, _config(method, method.get("budget") if budget is None else budget), max_length=max_length)


def _nbytes(cache) -> int:
    return cache.nbytes() if hasattr(cache, "nbytes") else transformers_cache_bytes(cache)


def _kept(cache) -> int:
    return cache.kept_length() if hasattr(cache, "kept_length") else cache.layers[0].keys.shape[-2]


@torch.inference_mode()
def cmd_sanity(command: dict) -> dict:
    """Logits of the plain DynamicCache (saved for the peer's comparison) and of our full 16-bit cache."""
    model = STATE["model"]
    ids = ids_tensor(command["ids"])
    reference = model(input_ids=ids, past_key_values=_cache({"kind": "dynamic"}, ids.shape[1])).logits[0]
    torch.save(reference, command["save_logits"])
    ours = model(input_ids=ids, past_key_values=_cache(
        {"kind": "ours", "policy": "full", "kv_bits": 16}, ids.shape[1])).logits[0]
    return {"tokens": ids.shape[1], "ours_full16_vs_dynamic_max_abs_logit_diff": (ours - reference).abs().max().item()}


@torch.inference_mode()
def cmd_needle(command: dict) -> dict:
    model = STATE["model"]
    inputs = load_inputs(command["inputs"])
    max_new = command["max_new_tokens"]
    results = []
    for method in command["methods"]:
        for item_index, item in enumerate(inputs["needle"]):
            began = time.perf_counter()
            record = {"method": method["name"], "item": item_index, "questions": []}
            try:
                context = ids_tensor(item["context_ids"])
                longest_question = max(len(q["ids"]) for q in item["questions"])
                compressed = method["kind"] == "ours" and method["policy"] != "full"
                if compressed:  # compress-then-ask: the context alone is compressed, then frozen per question
                    from h2o_compress.runtime.generation import make_scored_cache
                    from h2o_compress.runtime.prefill import prefill

                    config = _config(method, max(int(context.shape[1] * method["keep"]), 1))
                    cache = make_scored_cache(model, STATE["tokenizer"], context, config, context.shape[1])
                    prefill(model, context, cache)  # as h2o_compress.compress (kvzip, lookahead: scored first)
                else:
                    cache = _cache(method, context.shape[1] + longest_question + max_new)
                    model(input_ids=context, past_key_values=cache, logits_to_keep=1)
                record.update(context_kept_tokens=_kept(cache), context_kv_bytes=_nbytes(cache),
                              capacity=getattr(cache, "capacity", None))

                def fork():
                    extra = longest_question + max_new
                    return cache.frozen_copy(cache.seen_tokens() + extra) if compressed else copy.deepcopy(cache)

                for question in item["questions"]:
                    answer = question["answer_ids"]
                    forced_cache = fork()
                    forced = ids_tensor(question["ids"] + answer[:-1])
                    nll = answer_nll(model(input_ids=forced, past_key_values=forced_cache).logits, answer)
                    del forced_cache
                    live = fork()
                    logits = model(input_ids=ids_tensor(question["ids"]), past_key_values=live, logits_to_keep=1).logits
                    generated = [int(logits[0, -1].argmax())]
                    for _ in range(max_new - 1):  # as kvpress's generate_answer: the last token is not fed
                        logits = model(input_ids=torch.tensor([[generated[-1]]]), past_key_values=live).logits
                        generated.append(int(logits[0, -1].argmax()))
                        if generated[-1] in STATE["eos"]:
                            break
                    record["questions"].append({"answer_ids": generated, "answer_nll": nll,
                                                "kv_bytes": _nbytes(live), "kept_tokens": _kept(live)})
                    del live
            except Exception as exc:
                record["error"] = f"{type(exc).__name__}: {exc}"
                log("needle", method["name"], "failed:", record["error"])
            record["seconds"] = time.perf_counter() - began
            results.append(record)
            log("needle", method["name"], item_index, f"{record['seconds']:.1f}s")
    return {"results": results}


@torch.inference_mode()
def cmd_ppl(command: dict) -> dict:
    """Streaming perplexity, ``chunk`` tokens per pass; the budget fraction is relative to the stream length."""
    model = STATE["model"]
    ids, chunk = load_inputs(command["inputs"])["ppl_ids"], command["chunk"]
    results = []
    for method in command["methods"]:
        record = {"method": method["name"]}
        began = time.perf_counter()
        try:
            cache = _cache(method, len(ids))

            def step(piece, start):
                return model(input_ids=piece, past_key_values=cache).logits

            nll, seconds = stream_nll_chunks(step, ids, chunk)
            record.update(nll=nll, perplexity=perplexity(nll), seconds=seconds, kv_bytes=_nbytes(cache),
                          kept_tokens=_kept(cache))
        except Exception as exc:
            record["error"] = f"{type(exc).__name__}: {exc}"
            log("ppl", method["name"], "failed:", record["error"])
        record["wall_s"] = time.perf_counter() - began
        results.append(record)
        log("ppl", method["name"], f"{record['wall_s']:.1f}s")
    return {"results": results}


@torch.inference_mode()
def cmd_speed(command: dict) -> dict:
    model = STATE["model"]
    method = command["method"]
    ids = ids_tensor(load_inputs(command["inputs"])["speed_ids"][str(command["length"])])
    record = {"method": method["name"], "length": ids.shape[1]}
    try:
        with PeakRSS() as memory:
            cache = _cache(method, ids.shape[1] + command["steps"] + 1)
            began = time.perf_counter()
            logits = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits
            record["prefill_s"] = time.perf_counter() - began
            memory.mark()
            record.update(decode_timing(lambda token, i: model(input_ids=token, past_key_values=cache).logits,
                                        logits, command["steps"], make_probe(model)))
        record.update(kv_bytes=_nbytes(cache), kept_tokens=_kept(cache),
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

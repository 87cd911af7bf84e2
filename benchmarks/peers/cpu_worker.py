"""One timed run of one engine for ``benchmarks/cpu_peers.py``, in a process of its own (clean peak RSS).

    python benchmarks/peers/cpu_worker.py JOB.json

The job (JSON, written by the orchestrator) names the engine (``ours``, ``llama.cpp`` or ``openvino``), its
options, the file of prompt token ids, the new tokens and the threads; the result (JSON) goes to the job's
``out`` path. The worker loads the engine, warms it up on the first 32 prompt tokens (2 new tokens), then runs the
timed prefill + greedy decode of exactly ``new_tokens`` tokens (end of sequence ignored), and reports the seconds,
the generated ids, the KV bytes it holds at the end, and its peak RSS.

Only the standard library at import time: this file runs under the main environment (ours: torch,
transformers 5.23) and under the peers' environment (llama-cpp-python, OpenVINO GenAI), where importing torch
would add its own resident memory to the engine's figure.
"""

from __future__ import annotations

import json
import sys
import time
import traceback

from process_memory import high_water_mark, reset_high_water_mark, rss_bytes  # this file's folder

WARMUP_TOKENS = 32
OV_BLOCK = 32  # OpenVINO's CPU KV-cache block (tokens): eviction sizes must be multiples of it


# ------------------------------------------------------------------------------------------------------ ours


class Ours:
    """h2o-compress: ``load_model`` (CPU defaults, or the job's ``weights_bits``), a CompressedCache, the decode
    step `generate` runs on CPU (`resolve_compile` decides compilation as `generate` does: off on CPU)."""

    def __init__(self, job: dict):
        import torch

        torch.set_num_threads(job["threads"])
        from h2o_compress import CompressionConfig, load_model

        options = job["options"]
        kwargs = {} if options.get("weights_bits") is None else {"weights_bits": options["weights_bits"]}
        self.model, _ = load_model(options.get("model", "smollm2-135m"), device="cpu", **kwargs)
        self.config = CompressionConfig(policy=options["policy"], budget=options["budget"], kv_bits=options["kv_bits"])
        self.torch = torch
        self.version = _version("h2o-compress")

    def weights_read_bytes(self) -> int:
        """Weight bytes one decode step reads: every parameter and buffer (packed int8 weights and scales
        included) but the input embedding table, of which a step reads one row, unless the output head is tied
        to it (then the head reads it all)."""
        from h2o_compress.models.weights import loaded_weight_bytes

        total = loaded_weight_bytes(self.model)
        embedding = self.model.get_input_embeddings().weight
        head = getattr(self.model.get_output_embeddings(), "weight", None)
        tied = isinstance(head, self.torch.Tensor) and head.data_ptr() == embedding.data_ptr()
        return total if tied else total - embedding.numel() * embedding.element_size()

    def run(self, ids: list[int], new_tokens: int) -> dict:
        torch = self.torch
        from h2o_compress import make_cache
        from h2o_compress.runtime.compiled import compiled_decode_step, decode_one, decode_step, resolve_compile
        from h2o_compress.runtime.prefill import prefill

        with torch.inference_mode():
            prompt = torch.tensor([ids], dtype=torch.long)
            cache = make_cache(self.model, self.config, max_length=len(ids) + new_tokens)
            compiled = resolve_compile(None, cache, prompt.device, self.model)
            step = compiled_decode_step(self.model, prompt.device) if compiled else decode_step
            began = time.perf_counter()
            generated = [int(prefill(self.model, prompt, cache).argmax(-1))]
            prefilled = time.perf_counter()
            for index in range(new_tokens - 1):
                token = torch.tensor([[generated[-1]]], dtype=torch.long)
                generated.append(int(decode_one(step, self.model, cache, token, len(ids) + index).argmax(-1)))
            ended = time.perf_counter()
        return {"prefill_s": prefilled - began, "decode_s": ended - prefilled, "generated": generated,
                "kv_bytes": cache.nbytes(), "kept_tokens": cache.kept_length(), "compiled": compiled,
                "weights_read_bytes": self.weights_read_bytes(), "weight_products_s": self.weight_products_s()}

    def weight_products_s(self, repeats: int = 20) -> float:
        """Seconds one decode step spends in its weights' products alone (`weight_products_seconds` over
        `product_layers`). Nothing else of the step runs, so ``1 / seconds`` bounds the decode tokens/s any step
        built on these kernels can reach."""
        return weight_products_seconds(product_layers(self.model), repeats)


def product_layers(model) -> list:
    """Every linear layer of ``model`` in model order: packed (``Int8Linear``, ``Int4Linear``: their ``PACKED``
    flag) or an fp ``nn.Linear``, the output head included (last)."""
    import torch

    return [m for m in model.modules() if getattr(type(m), "PACKED", False) or isinstance(m, torch.nn.Linear)]


def weight_products_seconds(layers: list, passes: int = 20) -> float:
    """Median seconds of calling ``layers`` in order, each on one random row ``[1, 1, in_features]`` as a decode
    step calls it, over ``passes`` passes after one warm-up pass."""
    import statistics

    import torch

    rows = [torch.randn(1, 1, layer.in_features) for layer in layers]
    times = []
    with torch.inference_mode():
        for _ in range(passes + 1):
            began = time.perf_counter()
            for layer, row in zip(layers, rows):
                layer(row)
            times.append(time.perf_counter() - began)
    return statistics.median(times[1:])


# ------------------------------------------------------------------------------------------------- llama.cpp


class LlamaCpp:
    """llama.cpp through llama-cpp-python on the GGUF file: ``Llama.eval`` of the prompt (``n_batch`` tokens per
    pass), then one ``eval`` per token, greedy from the last logits."""

    def __init__(self, job: dict):
        import llama_cpp

        options = job["options"]
        kinds = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}
        kv = kinds[options["kv_type"]]
        self.llm = llama_cpp.Llama(
            model_path=options["gguf"], n_ctx=job["prompt_tokens"] + job["new_tokens"] + 64,
            n_threads=job["threads"], n_threads_batch=job["threads"], n_batch=options.get("n_batch", 512),
            type_k=kv, type_v=kv, flash_attn=options.get("flash_attn", False), verbose=False)
        self.n_vocab = self.llm.n_vocab()
        self.version = _version("llama_cpp_python")

    def _next(self) -> int:
        import numpy

        logits = numpy.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.n_vocab,))
        return int(logits.argmax())

    def run(self, ids: list[int], new_tokens: int) -> dict:
        self.llm.reset()
        began = time.perf_counter()
        self.llm.eval(ids)
        generated = [self._next()]
        prefilled = time.perf_counter()
        for _ in range(new_tokens - 1):
            self.llm.eval([generated[-1]])
            generated.append(self._next())
        ended = time.perf_counter()
        return {"prefill_s": prefilled - began, "decode_s": ended - prefilled, "generated": generated,
                "kept_tokens": self.llm.n_tokens}


# -------------------------------------------------------------------------------------------------- OpenVINO


class OpenVINO:
    """OpenVINO GenAI's ``LLMPipeline`` on an IR exported by ``optimum-cli export openvino``; with ``evict``, its
    ``CacheEvictionConfig`` (H2O-style scores, ``AggregationMode.SUM``) keeping ``budget`` x (prompt + new tokens)
    rounded up to whole blocks; ``kv`` sets the CPU plugin's ``KV_CACHE_PRECISION`` (its default: u8)."""

    def __init__(self, job: dict):
        import openvino_genai as genai

        options = job["options"]
        self.genai = genai
        scheduler = genai.SchedulerConfig()
        self.eviction = None
        if options.get("evict"):
            self.eviction = eviction_sizes(job["prompt_tokens"] + job["new_tokens"], options["budget"])
            scheduler.use_cache_eviction = True
            scheduler.cache_eviction_config = genai.CacheEvictionConfig(
                start_size=self.eviction["start_size"], recent_size=self.eviction["recent_size"],
                max_cache_size=self.eviction["max_cache_size"], aggregation_mode=genai.AggregationMode.SUM)
        properties = {"INFERENCE_NUM_THREADS": job["threads"]}
        if options.get("kv"):
            properties["KV_CACHE_PRECISION"] = options["kv"]
        self.pipe = genai.LLMPipeline(options["ir"], "CPU", scheduler_config=scheduler, **properties)
        self.version = _version("openvino_genai")

    def run(self, ids: list[int], new_tokens: int) -> dict:
        import numpy
        import openvino

        config = self.genai.GenerationConfig()
        config.max_new_tokens, config.min_new_tokens, config.ignore_eos, config.do_sample = new_tokens, new_tokens, True, False
        inputs = self.genai.TokenizedInputs(openvino.Tensor(numpy.array([ids], dtype=numpy.int64)),
                                            openvino.Tensor(numpy.ones((1, len(ids)), dtype=numpy.int64)))
        began = time.perf_counter()
        result = self.pipe.generate(inputs, config)
        wall = time.perf_counter() - began
        metrics = result.perf_metrics
        prefill_s = metrics.get_ttft().mean / 1000
        generated = [int(t) for t in result.tokens[0]]
        return {"prefill_s": prefill_s, "decode_s": max(wall - prefill_s, 0.0), "generated": generated,
                "ov_tpot_s": metrics.get_tpot().mean / 1000, "ov_generate_s": metrics.get_generate_duration().mean / 1000,
                "eviction": self.eviction}


def eviction_sizes(tokens: int, budget: float) -> dict:
    """OpenVINO's eviction sizes for ``budget`` x ``tokens`` held: 1 start block, recent tokens a quarter of the
    budget (at least one block), the rest evictable; every size a multiple of `OV_BLOCK`."""
    blocks = lambda count: max(1, -(-int(count) // OV_BLOCK))  # noqa: E731
    start = OV_BLOCK
    recent = blocks(budget * tokens / 4) * OV_BLOCK
    total = max(blocks(budget * tokens) * OV_BLOCK, start + recent + OV_BLOCK)
    return {"start_size": start, "recent_size": recent, "max_cache_size": total}


# ------------------------------------------------------------------------------------------------------ main

ENGINES = {"ours": Ours, "llama.cpp": LlamaCpp, "openvino": OpenVINO}


def _version(distribution: str) -> str:
    import importlib.metadata as metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "?"


def run_job(job: dict) -> dict:
    """Load, warm up, reset the peak RSS mark, run the timed generation; the result record."""
    with open(job["ids_file"]) as handle:
        ids = json.load(handle)[: job["prompt_tokens"]]
    began = time.perf_counter()
    engine = ENGINES[job["engine"]](job)
    load_s = time.perf_counter() - began
    loaded_rss = rss_bytes()
    engine.run(ids[:WARMUP_TOKENS], 2)
    # VmHWM, not ru_maxrss: Linux carries the parent's maxrss into a forked child, across exec
    load_peak = high_water_mark() or 0
    exact = reset_high_water_mark()
    result = engine.run(ids, job["new_tokens"])
    run_peak = high_water_mark() or 0
    steps = len(result["generated"]) - 1
    result.update(
        engine=job["engine"], setting=job["setting"], version=engine.version, prompt_tokens=len(ids),
        new_tokens=len(result["generated"]), load_s=load_s, decode_steps=steps,
        decode_tokens_per_s=steps / result["decode_s"] if result["decode_s"] > 0 else None,
        prefill_tokens_per_s=len(ids) / result["prefill_s"] if result["prefill_s"] > 0 else None,
        end_to_end_s=result["prefill_s"] + result["decode_s"],
        peak_rss_bytes=max(load_peak, run_peak), loaded_rss_bytes=loaded_rss,
        run_peak_rss_bytes=run_peak if exact else None, threads=job["threads"])
    return result


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: cpu_worker.py JOB.json")
    with open(sys.argv[1]) as handle:
        job = json.load(handle)
    try:
        result = run_job(job)
    except Exception as exc:  # the orchestrator records the error line and goes on
        traceback.print_exc(file=sys.stderr)
        result = {"engine": job.get("engine"), "setting": job.get("setting"), "error": f"{type(exc).__name__}: {exc}"}
    with open(job["out"], "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()

"""Measured ``cache.nbytes()`` against the planner's prediction, on tiny random models and the real SmolLM2.

    python benchmarks/planner_agreement.py            # ~30 s on 2 CPU cores

Tiny models (random LLaMA/GQA with head_dim 128, OPT, GPT-NeoX) run a prefill of random tokens and greedy
one-token steps, as ``generate`` does; SmolLM2 runs ``h2o_compress.generate`` on a real prompt (batch 1) and
the same manual loop at batch 3. Prints a markdown table; every difference is expected to be 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from conftest import tiny_llama, tiny_neox, tiny_opt  # noqa: E402
from test_planner import predicted, run_cache  # noqa: E402

from h2o_compress import CompressionConfig, generate, load_model  # noqa: E402
from h2o_compress.models import model_dims  # noqa: E402
from h2o_compress.planner import cache_bytes, describe  # noqa: E402

C = CompressionConfig
TINY_CASES = [  # (model name, config, batch, prompt, new tokens)
    ("llama", C(policy="full"), 1, 40, 10),
    ("llama", C(policy="h2o", budget=0.5), 4, 40, 10),
    ("llama", C(policy="h2o", budget=0.25, kv_bits=4, group_size=32, residual=4), 2, 64, 33),
    ("llama", C(policy="h2o", budget=0.25, kv_bits=4, group_size=128, residual=8), 2, 64, 33),
    ("llama", C(policy="h2o", budget=0.5, kv_bits=8, group_size=64, residual=2), 3, 50, 21),
    ("llama", C(policy="h2o", budget=24, k_bits=8, v_bits=4, group_size=32, residual=4), 2, 50, 21),
    ("llama", C(policy="local", budget=0.3, kv_bits=4, group_size=64, residual=0), 4, 30, 30),
    ("llama", C(policy="sink", budget=0.4, kv_bits=8, group_size=128, residual=16), 1, 30, 30),
    ("llama", C(policy="full", kv_bits=4, group_size=32, residual=4), 8, 20, 12),
    ("llama", C(policy="h2o", budget=0.5, kv_bits=4, quant="nf4", group_size=64), 2, 40, 10),
    ("opt", C(policy="h2o", budget=0.4, kv_bits=4, residual=3), 2, 30, 15),
    ("neox", C(policy="sink", budget=0.5, kv_bits=8, residual=4), 2, 30, 15),
]
REAL_CASES = [
    C(policy="full"),
    C(policy="h2o", budget=0.5),
    C(policy="h2o", budget=0.2, kv_bits=4, group_size=32, residual=4),
    C(policy="h2o", budget=0.5, kv_bits=8, group_size=64, residual=8),
    C(policy="sink", budget=0.3, kv_bits=4, group_size=64, residual=4),
    C(policy="local", budget=0.25, k_bits=8, v_bits=4, group_size=32, residual=2),
]
PROMPT = "Explain in detail how a key-value cache speeds up autoregressive decoding in a transformer."


def row(model: str, config, batch: int, prompt: int, new: int, measured: int, guess: int) -> str:
    diff = (guess - measured) / measured if measured else 0.0
    return f"| {model} | {describe(config)} | {batch} | {prompt} + {new} | {measured:,} | {guess:,} | {diff:+.2%} |"


def main() -> None:
    torch.set_num_threads(1)
    print("| model | setting | batch | prompt + new | measured bytes | predicted bytes | diff |")
    print("|---|---|---:|---:|---:|---:|---:|")
    tiny = {"llama": tiny_llama(head_dim=128), "opt": tiny_opt(), "neox": tiny_neox()}
    for name, config, batch, prompt, new in TINY_CASES:
        cache = run_cache(tiny[name], config, batch, prompt, new)
        guess = predicted(tiny[name], config, batch, prompt, new).total
        print(row(f"tiny-{name}", config, batch, prompt, new, cache.nbytes(), guess))
    model, tokenizer = load_model("smollm2-135m", device="cpu")
    for config in REAL_CASES:
        result = generate(model, tokenizer, PROMPT, config, max_new_tokens=32)
        guess = cache_bytes(model_dims(model.config), config, 1, result.prompt_tokens, result.new_tokens - 1,
                            result.prompt_tokens + 32, torch.float32).total
        print(row("SmolLM2-135M generate", config, 1, result.prompt_tokens, result.new_tokens, result.kv_bytes, guess))
    for config in REAL_CASES[2:4]:
        cache = run_cache(model, config, 3, 100, 20)
        print(row("SmolLM2-135M", config, 3, 100, 20, cache.nbytes(), predicted(model, config, 3, 100, 20).total))


if __name__ == "__main__":
    main()

"""`RuntimeSpec`: how a setting's attention is run (the prefill's scoring chunks, its forward chunks and the decode
kernel), checked on its own. None of these changes which tokens are kept.

[`CompressionConfig`][h2o_compress.config.CompressionConfig] holds one as ``config.runtime`` and reads its fields
as flat settings (``config.attention_kernel``); what combines the kernel with the other parts (the parts the
Triton op does not read) the config checks.
"""

from __future__ import annotations

from dataclasses import dataclass

from h2o_compress.utils.checks import check_count
from h2o_compress.utils.errors import ConfigError, short

#: The decode steps a setting may ask for: ``auto`` picks, ``torch`` and ``triton`` force one.
ATTENTION_KERNELS = ("auto", "torch", "triton")
#: The most tokens a setting may name (a budget, chunk or sink count): far above the longest context of any model
#: this library knows.
MAX_TOKENS = 2**31 - 1
#: Tokens per forward pass of a prompt's prefill (``prefill_chunk_size``), chosen with
#: ``benchmarks/prefill_chunks.py`` (figures: ``benchmarks/results/prefill_chunks_cpu.md``): the smallest chunk
#: close to the one-pass time, at a fraction of the one pass's peak memory growth.
DEFAULT_PREFILL_CHUNK = 512


@dataclass(frozen=True)
class RuntimeSpec:
    """How attention is run; checked when made.

    Args:
        score_chunk_size: queries per chunk when a prefill's attention is scored (default 64), 1 to `MAX_TOKENS`.
        prefill_chunk_size: tokens per forward pass of a prompt's prefill (default 512, `DEFAULT_PREFILL_CHUNK`),
            up to `MAX_TOKENS`; ``0``: one pass.
        attention_kernel: the decode step, one of `ATTENTION_KERNELS`: ``auto`` (default), ``torch`` or
            ``triton``; all keep the same tokens.

    Raises:
        ConfigError: the first value out of range, naming it and what is allowed.
    """

    score_chunk_size: int = 64
    prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK
    attention_kernel: str = "auto"

    def __post_init__(self) -> None:
        check_count("score_chunk_size", self.score_chunk_size, maximum=None, allowed="an integer >= 1")
        if self.score_chunk_size > MAX_TOKENS:
            raise ConfigError(f"score_chunk_size={short(self.score_chunk_size)} is too large; allowed: an integer from "
                              f"1 to {MAX_TOKENS}")
        check_count("prefill_chunk_size", self.prefill_chunk_size, minimum=0, maximum=MAX_TOKENS,
                    allowed=f"an integer from 1 to {MAX_TOKENS} (tokens per forward pass), or 0 (the whole prompt in "
                            "one pass)")
        if not isinstance(self.attention_kernel, str) or self.attention_kernel not in ATTENTION_KERNELS:
            raise ConfigError(f"attention_kernel={short(self.attention_kernel)} is not supported; allowed: "
                              f"{', '.join(ATTENTION_KERNELS)}")

"""Pins what one compressed layer's compiled decode step dispatches (issue 14: few kernels per layer and step).

``benchmarks/decode_launches.py`` counts it with ``torch.profiler`` (top-level aten ops, Inductor kernel events,
custom op calls) and the Triton launches of ``h2o_compress::slot_decode_attention`` (under ``TRITON_INTERPRET=1``
on the CPU). Measured (benchmarks/results/decode_launches_cpu.md), per layer and step of an h2o 0.2 int4 cache,
head_dim 128, GQA 8/2, 2 layers (each layer's key and value depending on the previous layer's output, as in a
model), Inductor on CPU: no aten op outside Inductor's kernels (the new key's and value's Hadamard rotation is fused,
no extern matmul), 2 Inductor kernels (flags + rotation + ring write + quantize/insert; eviction), 1 op call = 2
Triton launches: 4 launches, issue 14's bound. A change that adds work to the step fails here; one that removes
some should lower the bounds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from h2o_compress.attention import slot_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import decode_launches  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and slot_attention.supported(torch.device("cpu"), 32, ()) is not None,
    reason="needs CUDA or TRITON_INTERPRET=1",
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pins Inductor's CPU counts (a GPU run reports its own)")
def test_compiled_fused_step_dispatch_counts():
    args = decode_launches.parse_args(["--prompt", "512", "--steps", "2", "--warmup", "1", "--modes",
                                       "fused compiled"])
    # prompt 512 (103 slots), the benchmark's shape: Inductor's fusion depends on the loop sizes; at prompt 64 (14
    # slots) it splits the second layer's flags from its ring write (2.5 kernels, 4.5 launches per layer)
    row = decode_launches.measure("fused compiled", args)
    assert row["custom_op_calls"] == 1 and row["triton_launches"] == 2  # the op: attention + scores + bases
    assert row["aten_ops"] == 0  # profiler: no top-level aten op left outside Inductor's kernels and the op
    assert 0 < row["inductor_kernel_events"] <= 2  # profiler: Inductor's cpp kernels run
    assert row["inductor_kernels"] <= 2 and row["extern_calls"] == 1  # the generated code agrees: the op alone
    assert row["launch_estimate"] <= 4  # issue 14: at most 4 kernels per layer besides the projections
    assert not [e for e in row["generated_externs"] if e.endswith("mm")]  # every rotation fused or in the op


def test_bad_mode_is_refused():
    with pytest.raises(SystemExit) as exc:
        decode_launches.parse_args(["--modes", "fused compiled,warp speed"])
    assert exc.value.code == 2

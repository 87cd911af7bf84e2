"""Pins what one compressed layer's compiled decode step dispatches (issue 14: few kernels per layer and step).

``benchmarks/decode_launches.py`` counts it with ``torch.profiler`` (top-level aten ops, Inductor kernel events,
custom op calls) and the Triton launches of ``h2o_compress::slot_decode_attention`` (under ``TRITON_INTERPRET=1``
on the CPU). Measured (benchmarks/results/decode_launches_cpu.md), per layer and step of an h2o 0.2 int4 cache,
head_dim 128, GQA 8/2, 2 layers, Inductor on CPU: 2 aten ops (the extern matmuls of the new key's and value's
Hadamard basis), 2.5 Inductor kernels, 1 op call = 2 Triton launches. A change that adds work to the step fails
here; one that removes some should lower the bounds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from h2o_compress.kernels import slot_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import decode_launches  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and slot_attention.supported(torch.device("cpu"), 32, ()) is not None,
    reason="needs CUDA or TRITON_INTERPRET=1",
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pins Inductor's CPU counts (a GPU run reports its own)")
def test_compiled_fused_step_dispatch_counts():
    args = decode_launches.parse_args(["--prompt", "64", "--steps", "2", "--warmup", "1", "--modes",
                                       "fused compiled"])
    row = decode_launches.measure("fused compiled", args)
    assert row["custom_op_calls"] == 1 and row["triton_launches"] == 2  # the op: attention + scores + bases
    assert 0 < row["aten_ops"] <= 2  # profiler: top-level aten ops left outside Inductor's kernels
    assert 0 < row["inductor_kernel_events"] <= 2.5  # profiler: Inductor's cpp kernels run
    assert row["inductor_kernels"] <= 2.5 and row["extern_calls"] <= 3  # the generated code agrees
    assert row["launch_estimate"] <= 6.5
    matmuls = [e for e in row["generated_externs"] if e.endswith("mm")]
    assert len(matmuls) <= 2 * args.layers  # the new key's and value's rotations; the query's and output's are in the op


def test_bad_mode_is_refused():
    with pytest.raises(SystemExit) as exc:
        decode_launches.parse_args(["--modes", "fused compiled,warp speed"])
    assert exc.value.code == 2

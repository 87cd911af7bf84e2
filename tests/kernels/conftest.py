"""Kernel tests: on a CUDA GPU when there is one, else under Triton's CPU interpreter.

``TRITON_INTERPRET`` must be set before :mod:`h2o_compress.kernels.decode_attention` is imported, because
``@triton.jit`` chooses the interpreter when the decorator runs; conftest modules load before test modules.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch


def _interpret_triton_language() -> None:
    """Re-wrap ``triton.language``'s own ``@jit`` helpers (``tl.zeros``, ``tl.max``, ``tl.sum``...) for the
    interpreter. They were decorated when triton was first imported, which tests/conftest.py triggers (its
    transformers models import triton) before this file can set ``TRITON_INTERPRET``; compiled-mode helpers
    raise "Cannot call @triton.jit'd outside of the scope of a kernel" inside interpreted kernels."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    wrapped: dict[int, InterpretedFunction] = {}  # one wrapper per function, so identity checks still hold
    for name, module in list(sys.modules.items()):
        if module is not None and (name == "triton.language" or name.startswith("triton.language.")):
            for attr, value in list(vars(module).items()):
                if isinstance(value, JITFunction):
                    setattr(module, attr, wrapped.setdefault(id(value), InterpretedFunction(value.fn)))


try:
    import triton  # noqa: F401
except ImportError:  # the test modules skip themselves (pytest.importorskip); a conftest cannot skip
    triton = None

if triton is not None and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    _interpret_triton_language()


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"

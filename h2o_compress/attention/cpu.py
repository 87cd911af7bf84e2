"""The compressed decode step of one layer as one native call on the CPU (``cpu_decode.c``).

On a CPU the decode step of a small model is bound by per-op overhead, not arithmetic: the torch form of a
compressed layer's step dispatches ~150 small ops, each a few microseconds. ``cpu_decode.c`` does the whole
step of a layer (ring in, the leaving token quantized once into the first empty slot, attention over the
dequantized slots and the ring with one softmax per query head, H2O score accumulation, the Hadamard bases
folded in) in one call, reading the int4/int8 codes in registers. Eviction stays in torch: it ranks by the
policy's [`priority`][h2o_compress.policies.EvictionPolicy.priority], stated once, in Python.

Threads: each decode call passes ``torch.get_num_threads()`` (read in `_decode`, so the custom op's schema has
no thread argument and a compiled step reads it at run time). Where that is above 1, the batch has two sequences
or more and the layer's work (sequences x KV heads x (slots + ring) x head dim) reaches the kernel's threshold
(``h2o_cpu_decode_parallel_work()``), the kernel splits the sequences (never the heads of one) over that many
threads, the calling thread among them; each sequence writes only its own rows, so the results are bitwise those
of one thread. Below it, one thread runs every sequence, allocating nothing per step. The library is built with
OpenMP (`FLAGS`): its libgomp is the one torch already loaded, so the threads are torch's own pool, which spins
after each torch op and takes the work at once (threshold 1 << 14); pthreads of the kernel's own, sharing the
other cores with that spinning pool, gained little where the pool halves the kernel's time in a batched step.
A compiler without OpenMP builds it with `FLAGS_WITHOUT_OPENMP` instead: pthreads started per call (1 << 17).

The same library holds ``cpu_prefill.c``, the scored multi-token step (prefill, a chunk: output and H2O column
sums from one softmax, `h2o_compress.attention.prefill.attention_with_sums`).

The C files are compiled once per machine with the system C compiler (``$CC``, default ``gcc``; about a second)
into ``$H2O_COMPRESS_CACHE/kernels`` (a directory only this user can write: `private_dir`)
and loaded with `ctypes`, only while its bytes match the SHA-256 recorded when it was built
(`_verified`). Where no compiler works, or with ``H2O_COMPRESS_NATIVE=0``, `library` returns ``None``
(with one warning when compiling failed) and the cache runs its torch form: the same results. Under
``torch.compile`` the call is the custom op
``h2o_compress::cpu_decode_layer`` (a fake implementation gives Dynamo its output shape), so the compiled and
the eager step run the same kernel.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from h2o_compress.attention.buffers import Eviction, SlotBuffers
from h2o_compress.formats import IntQuantizer, NoQuantizer
from h2o_compress.utils.errors import ConfigError
from h2o_compress.utils.paths import check_private, private_dir

SOURCES = (Path(__file__).with_name("cpu_decode.c"), Path(__file__).with_name("cpu_prefill.c"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=gnu11", "-shared", "-fPIC", "-pthread")
FLAGS_WITHOUT_OPENMP = tuple("-fopenmp-simd" if flag == "-fopenmp" else flag for flag in FLAGS)  # no libgomp
ELEMENTS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # storage element codes of cpu_decode.c
MAX_HEAD_DIM = 512


def _machine_key() -> str:
    """What a ``-march=native`` build depends on: the CPU model and flags (``/proc/cpuinfo``) and the platform."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags", "Features"))}))
    except OSError:
        cpu = platform.processor()
    return cpu + platform.machine() + platform.system()


def _digest_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _verified(target: Path) -> bool:
    """Whether ``target`` may be loaded: a regular file of this user that only this user can write
    (`check_private`) whose bytes match the digest recorded when this user built it
    (``<target>.sha256``, same checks). Anything else is rebuilt, never loaded."""
    record = target.with_name(target.name + ".sha256")
    try:
        check_private(target, "file")
        check_private(record, "file")
        return record.read_text(encoding="ascii").strip() == _digest_file(target)
    except (OSError, ConfigError, UnicodeDecodeError):
        return False


def _build(compiler: str, target: Path) -> None:
    """Compile `SOURCES` with `FLAGS` (or, where they fail, `FLAGS_WITHOUT_OPENMP`) into ``target`` (atomically: a
    concurrent build never leaves a half-written file) and record its SHA-256 beside it (``<target>.sha256``), which
    `_verified` checks before every load.

    Raises:
        OSError, subprocess.CalledProcessError: the compiler is missing or failed.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(fd)
    try:
        for flags in (FLAGS, FLAGS_WITHOUT_OPENMP):  # the second where the compiler has no OpenMP
            done = subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", partial, "-lm"], capture_output=True,
                                  text=True)
            if done.returncode == 0:
                break
        else:
            raise subprocess.CalledProcessError(done.returncode, done.args, done.stdout, done.stderr)
        os.chmod(partial, 0o700)
        digest = _digest_file(Path(partial))
        fd, record = tempfile.mkstemp(dir=target.parent, suffix=".sha256.partial")
        with os.fdopen(fd, "w", encoding="ascii") as out:
            out.write(digest + "\n")
        os.replace(record, target.with_name(target.name + ".sha256"))
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled kernels (decode step and scored prefill; built at the first call of a process on a new machine,
    then loaded from the cache directory), or ``None`` when they are switched off (``H2O_COMPRESS_NATIVE=0``) or
    cannot be built (one warning names the compiler's error; decoding and prefill then run their torch forms)."""
    if os.environ.get("H2O_COMPRESS_NATIVE", "1").strip() == "0":
        return None
    compiler = os.environ.get("CC", "").strip() or "gcc"
    if shutil.which(compiler) is None:
        warnings.warn(f"no C compiler {compiler!r} on PATH: the CPU decode step and scored prefill run their slower torch forms", stacklevel=2)
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
        key = hashlib.sha256(
            "\0".join((*(source.read_text() for source in SOURCES), " ".join(FLAGS), version, _machine_key())).encode()
        ).hexdigest()[:16]
        try:
            target = private_dir("kernels") / f"cpu_decode-{key}.so"
        except ConfigError as exc:  # a cache directory that is not this user's own: build for this process only
            warnings.warn(f"{exc}; the CPU decode kernel is built for this process only", stacklevel=2)
            target = Path(tempfile.mkdtemp(prefix="h2o-compress-")) / f"cpu_decode-{key}.so"
        if not _verified(target):
            try:
                _build(compiler, target)
            except PermissionError:  # an unwritable cache directory: build for this process only
                target = Path(tempfile.mkdtemp(prefix="h2o-compress-")) / target.name
                _build(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", None) or str(exc)
        warnings.warn(
            f"building the CPU decode kernel with {compiler!r} failed ({detail.strip()[-300:]}); the CPU decode "
            "step and scored prefill run their slower torch forms", stacklevel=2,
        )
        return None
    lib.h2o_cpu_decode_layer.restype = ctypes.c_int
    lib.h2o_cpu_prefill_attention.restype = ctypes.c_int
    lib.h2o_cpu_prefill_tile.restype = ctypes.c_int
    lib.h2o_cpu_decode_parallel_work.restype = ctypes.c_int
    return lib


def supported(device: torch.device, dtype: torch.dtype, storage_dtype: torch.dtype, head_dim: int, formats) -> bool:
    """Whether a layer on ``device`` with model ``dtype``, window/16-bit storage ``storage_dtype``, ``head_dim``
    and key/value quantizers ``formats`` can run the native step (and the kernel builds)."""
    return (
        device.type == "cpu"
        and dtype in ELEMENTS
        and storage_dtype in ELEMENTS
        and head_dim <= MAX_HEAD_DIM
        and all(type(f) in (IntQuantizer, NoQuantizer) for f in formats)  # a subclass may quantize otherwise
        and library() is not None
    )


def _pointer(tensor: torch.Tensor | None) -> ctypes.c_void_p | None:
    return None if tensor is None else ctypes.c_void_p(tensor.data_ptr())


def _decode(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, scale: float,
    k_bits: int, k_group: int, k_data: torch.Tensor, k_scale_zero: torch.Tensor | None, k_basis: torch.Tensor | None,
    v_bits: int, v_group: int, v_data: torch.Tensor, v_scale_zero: torch.Tensor | None, v_basis: torch.Tensor | None,
    store_positions: torch.Tensor, owner: torch.Tensor | None, store_scores: torch.Tensor | None,
    ring_keys: torch.Tensor | None,
    ring_values: torch.Tensor | None, ring_positions: torch.Tensor | None, ring_scores: torch.Tensor | None,
    seen: torch.Tensor, first_real: torch.Tensor, finite: torch.Tensor, capacity: int, recent: int, sinks: int,
    rank: torch.Tensor | None, evict: bool, reference_seen: torch.Tensor | None, consistent: torch.Tensor,
    replace_scores: bool, value_norms: torch.Tensor | None = None, prior_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """One call of ``cpu_decode.c`` over a layer's buffers (`decode_layer` unpacks them): fp32
    ``[batch, q_heads, head_dim]`` output. Eager steps call it directly; compiled ones through the custom op
    `cpu_decode_layer` (the same function, so both run the same kernel). The kernel may split the sequences over
    ``torch.get_num_threads()`` threads, read at each call (bitwise the same results as one thread).

    Raises:
        RuntimeError: the kernel refused a shape (``head_dim`` above `MAX_HEAD_DIM`, query heads not a
            multiple of KV heads) or could not allocate its scratch.
        ValueError: store positions whose rows are not ``[batch, kv_heads]`` (or ``[batch, 1]`` with ``owner``).
    """
    out = torch.empty_like(q)
    batch, q_heads, head_dim = q.shape
    kv_heads, slots = k_new.shape[1], store_positions.shape[2]
    rows = 1 if owner is not None else kv_heads  # a head-adaptive pool is one row of slots per sequence
    if store_positions.shape[:2] != (batch, rows) or (owner is not None and owner.shape != store_positions.shape):
        raise ValueError(f"store rows {tuple(store_positions.shape[:2])} do not fit batch {batch} x {rows} (owner "
                         f"{None if owner is None else tuple(owner.shape)}): the kernel would read past the store")
    size = 0 if ring_positions is None else ring_positions.shape[1]
    storage = k_data if k_bits == 16 else (v_data if v_bits == 16 else ring_keys)
    element = ELEMENTS[storage.dtype] if storage is not None else 0
    status = library().h2o_cpu_decode_layer(
        batch, q_heads, kv_heads, head_dim, slots, size, ctypes.c_float(scale),
        _pointer(q), _pointer(k_new), _pointer(v_new), _pointer(out),
        k_bits, k_group, _pointer(k_data), _pointer(k_scale_zero), _pointer(k_basis),
        v_bits, v_group, _pointer(v_data), _pointer(v_scale_zero), _pointer(v_basis),
        element, _pointer(store_positions), _pointer(store_scores),
        _pointer(ring_keys), _pointer(ring_values), _pointer(ring_positions), _pointer(ring_scores),
        _pointer(seen), _pointer(first_real), _pointer(finite),
        capacity, recent, sinks, _pointer(rank), int(evict), _pointer(reference_seen), _pointer(consistent),
        int(replace_scores), _pointer(owner), _pointer(value_norms), _pointer(prior_weights),
        torch.get_num_threads(),  # read here, not an argument: the custom op's schema stays as it is
    )
    if status:
        raise RuntimeError(f"cpu_decode.c refused the step (status {status}): a shape the kernel does not take")
    return out


#: The custom op ``h2o_compress::cpu_decode_layer`` around `_decode`, what ``torch.compile`` traces.
cpu_decode_layer = torch.library.custom_op(
    "h2o_compress::cpu_decode_layer",
    mutates_args=(
        "k_data", "k_scale_zero", "v_data", "v_scale_zero", "store_positions", "owner", "store_scores", "ring_keys",
        "ring_values", "ring_positions", "ring_scores", "seen", "first_real", "finite", "consistent", "value_norms",
    ),
    device_types="cpu",
)(_decode)


@cpu_decode_layer.register_fake
def _(q, *args, **kwargs):
    return torch.empty_like(q)


def decode_layer(
    buffers: SlotBuffers, eviction: Eviction, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
    scale: float, reference_seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step of a compressed layer on the CPU in one native call.

    Updates ``buffers`` in place: the new token into the ring (the leaving one quantized into the first empty slot of
    its head, or, with a head-adaptive pool's int8 ``owner`` tags, the lowest free pool slot), the scores, ``seen``,
    ``first_real``, ``finite``, ``consistent`` (against ``reference_seen``, layer 0's count) and, for a policy that
    weighs values (VATP), ``norms`` of the token it moves in; evicts as ``eviction`` says (else the caller evicts).

    Args:
        buffers: the layer's store, ring and counters (`SlotBuffers`).
        eviction: the kernel's eviction (`Eviction`; ``evict=False``: none).
        query: ``[batch, q_heads, 1, head_dim]``, in the model's basis.
        keys: the new token's keys ``[batch, kv_heads, 1, head_dim]`` as the model made them (not rotated).
        values: as ``keys``.
        scale: softmax scale.
        reference_seen: int64 0-dim, layer 0's ``seen``, or ``None`` (layer 0 itself).

    Returns:
        The attention output ``[batch, 1, q_heads, head_dim]`` in the query's dtype.
    """
    batch, q_heads, _, head_dim = query.shape
    k, v, ring = buffers.keys, buffers.values, buffers.ring
    args = (
        query.reshape(batch, q_heads, head_dim).float().contiguous(),
        keys.reshape(batch, -1, head_dim).float().contiguous(),
        values.reshape(batch, -1, head_dim).float().contiguous(),
        float(scale),
        k.bits, k.group, k.data, k.scale_zero, k.basis,
        v.bits, v.group, v.data, v.scale_zero, v.basis,
        buffers.positions, buffers.owner, buffers.scores,
        *((None,) * 4 if ring is None else ring),
        buffers.seen, buffers.first_real, buffers.finite,
        eviction.capacity, eviction.recent, eviction.sinks, eviction.rank, eviction.evict, reference_seen,
        buffers.consistent, eviction.replace_scores, buffers.norms, eviction.prior_weights,
    )
    # compiled: the custom op; eager: the same function without the op's dispatch (microseconds per layer and step)
    out = cpu_decode_layer(*args) if torch.compiler.is_compiling() else _decode(*args)
    return out.view(batch, 1, q_heads, head_dim).to(query.dtype)

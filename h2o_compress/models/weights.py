"""How a model's weights are loaded: bitsandbytes 8/4-bit weights and accelerate's ``device_map`` (a leaf module).

[`h2o_compress.load_model`][h2o_compress.load_model] checks every option here before anything is read from disk, then builds the
transformers ``BitsAndBytesConfig`` (LLM.int8, Dettmers et al. 2022, arXiv 2208.07339; NF4, Dettmers et al. 2023,
arXiv 2305.14314) and hands ``device_map``/``max_memory``/``offload_folder`` to ``from_pretrained`` (accelerate's
big-model inference: https://huggingface.co/docs/accelerate/usage_guides/big_modeling).

The compressed cache needs nothing from here to follow a split model: each cache layer allocates its storage on
the device of the keys its attention layer hands it at the first update, which is the execution device accelerate
runs that layer on (``module._hf_hook.execution_device``; CPU/disk-offloaded weights are moved there per forward).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from h2o_compress.models.int4_linear import Int4Linear
from h2o_compress.models.int8_linear import Int8Linear
from h2o_compress.utils.checks import is_integer
from h2o_compress.utils.errors import ConfigError, ModelLoadError, short
from h2o_compress.utils.files import parse_json, read_text

WEIGHT_BITS = (16, 8, 4)
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
DEVICE_MAP_ALLOWED = (
    "auto, balanced, balanced_low_0, sequential, or a JSON object (or .json file) mapping module names to a GPU "
    "index, cuda:N, cpu or disk"
)
MAX_DEVICE_MAP_BYTES = 2**20  # a map of every module of a 1,000-layer model is far smaller
MAX_INDEX_DIGITS = 6  # a GPU index (or a byte count's digits: see MAX_AMOUNT_DIGITS)
MAX_AMOUNT_DIGITS = 18
MAX_MEMORY_BYTES = 2**80  # far beyond any machine; as the planner's memory amounts
MAX_MEMORY_ALLOWED = "entries DEVICE=AMOUNT separated by commas, DEVICE a GPU index, cpu or disk, e.g. 0=20GiB,cpu=64GiB"


WEIGHT_BITS_ALLOWED = "16, 8, 4 or None (the default: 8 on CPU for the embedded smollm2-135m, else 16)"


def parse_device_map(text: str | None):
    """The CLI's ``--device-map``: ``None``/empty -> ``None``; a strategy name; a JSON object; a ``.json`` file.

    Raises:
        ConfigError: not one of those, or an entry `check_weight_options` refuses.
    """
    if text is None or not str(text).strip():
        return None
    text = str(text).strip()
    if text in DEVICE_MAP_STRATEGIES:
        return text
    source = text
    if len(text) > MAX_DEVICE_MAP_BYTES:  # before any parsing: a 10 MB map would take minutes to check
        raise ConfigError(f"device_map of {len(text)} characters is too long; allowed: at most {MAX_DEVICE_MAP_BYTES} "
                          f"({DEVICE_MAP_ALLOWED})")
    if not text.startswith("{"):
        path = Path(text)
        if path.suffix != ".json" or not path.is_file():
            raise ConfigError(f"device_map={short(text)} is invalid; allowed: {DEVICE_MAP_ALLOWED}")
        text = read_text(path, "device map file", ConfigError, limit=MAX_DEVICE_MAP_BYTES)
        value = parse_json(text, f"device map file {short(source)}", ConfigError, bounded=True)
    else:
        value = parse_json(text, f"device_map={short(source)}", ConfigError, bounded=True)
    return _checked_map(value)


def _ascii_int(text: str, digits: int) -> int | None:
    """``int(text)`` if ``text`` is 1 to ``digits`` ASCII digits, else ``None`` (``'²'``, ``'٣'``: not an index)."""
    if text.isascii() and text.isdigit() and len(text) <= digits:
        return int(text)
    return None


def _check_target(name: str, target, option: str = "device_map"):
    """One device-map value, normalised: ``0`` / ``"cuda:0"`` / ``"cpu"`` / ``"disk"``. Raises ConfigError."""
    where = f"{option}[{short(name)}]={short(target)}" if option == "device_map" else f"{option} device {short(target)}"
    if target in ("cpu", "disk"):
        return target
    if isinstance(target, str) and target.isdigit():  # ASCII digits only, a few of them: int('²') raises
        index = _ascii_int(target, MAX_INDEX_DIGITS)
        if index is None:
            raise ConfigError(f"{where} is invalid; allowed: a GPU index (at most {MAX_INDEX_DIGITS} ASCII digits), "
                              "cuda:N, cpu or disk")
        target = index
    if isinstance(target, str):
        try:
            device = torch.device(target)
        except (RuntimeError, TypeError):
            device = None
        if device is None or device.type != "cuda":
            raise ConfigError(f"{where} is invalid; allowed: a GPU index, cuda:N, cpu or disk")
        target = 0 if device.index is None else device.index
    if not is_integer(target) or target < 0:
        raise ConfigError(f"{where} is invalid; allowed: a GPU index, cuda:N, cpu or disk")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if target >= count:
        raise ConfigError(f"{where} names GPU {target} but this machine has {count} CUDA device(s); allowed: "
                          + ("cpu or disk" if not count else f"0 to {count - 1}, cpu or disk"))
    return target


def _checked_map(device_map):
    """``None``, a strategy name (`DEVICE_MAP_STRATEGIES`) or a dict {module name: target} with each target
    normalised (`_check_target`); for `check_weight_options` and `parse_device_map`. Raises ConfigError."""
    if device_map is None:
        return None
    if isinstance(device_map, str):
        if device_map not in DEVICE_MAP_STRATEGIES:
            raise ConfigError(f"device_map={short(device_map)} is invalid; allowed: {DEVICE_MAP_ALLOWED}")
        return device_map
    if not isinstance(device_map, dict) or not device_map:
        raise ConfigError(f"device_map={short(device_map)} is invalid; allowed: {DEVICE_MAP_ALLOWED}")
    checked = {}
    for name, target in device_map.items():
        if not isinstance(name, str):
            raise ConfigError(f"device_map key {short(name)} is not a module name; allowed: strings like 'model.layers.3'")
        checked[name] = _check_target(name, target)
    return checked


def parse_max_memory(value) -> dict | None:
    """``max_memory`` for accelerate: ``None``, a dict {device: amount} or the CLI's ``"0=20GiB,cpu=64GiB"``.

    Devices: a GPU index, ``cpu`` or ``disk``; amounts: bytes or a size accelerate reads (``20GiB``, ``500MB``).

    Raises:
        ConfigError: naming the bad entry.
    """
    from accelerate.utils import convert_file_size_to_int

    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        entries = {}
        for part in value.split(","):
            device, sep, amount = part.partition("=")
            if not sep:
                raise ConfigError(f"max_memory entry {short(part.strip())} is invalid; allowed: {MAX_MEMORY_ALLOWED}")
            device = device.strip()
            amount = amount.strip()
            if (device.isdigit() and _ascii_int(device, MAX_INDEX_DIGITS) is None
                    or amount.isdigit() and _ascii_int(amount, MAX_AMOUNT_DIGITS) is None):
                raise ConfigError(f"max_memory entry {short(part.strip())} is invalid (a GPU index of at most "
                                  f"{MAX_INDEX_DIGITS} ASCII digits, bytes of at most {MAX_AMOUNT_DIGITS}); "
                                  f"allowed: {MAX_MEMORY_ALLOWED}")
            entries[int(device) if device.isdigit() else device] = int(amount) if amount.isdigit() else amount
        value = entries
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"max_memory={short(value)} is invalid; allowed: {MAX_MEMORY_ALLOWED}")
    out = {}
    for device, amount in value.items():
        if device not in ("cpu", "disk"):
            _check_target("max_memory", device, option="max_memory")
        out[device] = _memory_amount(device, amount, convert_file_size_to_int)
    return out


def _memory_amount(device, amount, convert) -> int:
    """Bytes of one ``max_memory`` entry: an integer, or a size accelerate's ``convert`` reads (``"20GiB"``), from 1
    to `MAX_MEMORY_BYTES`.

    Raises:
        ConfigError: a bool, another type, an unreadable size, 0 or less, or beyond `MAX_MEMORY_BYTES` (``1e400GiB``
            overflows accelerate's float arithmetic: refused here, not an ``OverflowError``).
    """
    size = -1
    if is_integer(amount):
        size = amount
    elif isinstance(amount, str):
        try:
            size = convert(amount)
        except (ValueError, TypeError, AttributeError, OverflowError):
            size = -1
    if not is_integer(size) or not 0 < size <= MAX_MEMORY_BYTES:
        raise ConfigError(f"max_memory[{short(device)}]={short(amount)} is invalid; allowed: {MAX_MEMORY_ALLOWED} "
                          "(from 1 byte to 2**80 bytes)")
    return size


@dataclass(frozen=True)
class WeightOptions:
    """The weight-loading options of one load, checked together by `check_weight_options`.

    Attributes:
        bits: 16, 8, 4, or ``None`` (the default, which [`load_model`][h2o_compress.load_model] resolves by model
            and device).
        device_map: ``None``, a strategy name or a dict {module name: GPU index, ``cpu`` or ``disk``}.
        max_memory: ``None`` or {device: bytes} (with a strategy only).
        offload_folder: the folder for ``disk`` entries, or ``None``.
    """

    bits: int | None = None
    device_map: str | dict | None = None
    max_memory: dict | None = None
    offload_folder: str | None = None


def check_weight_options(weights_bits=None, device_map=None, max_memory=None, offload_folder=None,
                         device="auto") -> WeightOptions:
    """The options of how a model's weights are loaded, checked before anything is read from disk.

    ``weights_bits``: 16 (the model's dtype), 8 (packed int8 on CPU, LLM.int8 on CUDA), 4 (NF4) or ``None``.
    ``device_map``: as `_checked_map` (a GPU target must exist; module names are checked against the model when it
    is built). ``max_memory``: as `parse_max_memory`, with a strategy only. ``offload_folder``: the folder
    accelerate writes offloaded weights to (``<name>.dat`` + ``index.json``): needed when the map has ``disk``
    entries (created if missing); an existing path must be a directory holding nothing else; refused without a
    ``device_map`` (it would be ignored). ``device``: must stay ``auto`` (or ``None``) with a ``device_map``.

    Raises:
        ConfigError: the first bad value, naming it and what is allowed.
    """
    if weights_bits is not None and (not is_integer(weights_bits) or weights_bits not in WEIGHT_BITS):
        raise ConfigError(f"weights_bits={short(weights_bits)} is not supported; allowed: {WEIGHT_BITS_ALLOWED}")
    device_map = _checked_map(device_map)
    if device_map is not None and device not in (None, "auto"):
        raise ConfigError(f"device={short(device)} and a device_map were both given; allowed: one of them "
                          "(leave device at auto with a device_map)")
    max_memory = parse_max_memory(max_memory)
    if max_memory is not None and not isinstance(device_map, str):
        raise ConfigError("max_memory only applies to a device_map strategy; allowed: device_map='auto' (or "
                          "balanced, balanced_low_0, sequential) with max_memory")
    return WeightOptions(weights_bits, device_map, max_memory, _offload_folder(device_map, offload_folder))


def _offload_folder(device_map, offload_folder) -> str | None:
    """``offload_folder`` for `check_weight_options`, as a ``str``. Raises ConfigError."""
    if offload_folder is not None and not isinstance(offload_folder, (str, os.PathLike)):
        raise ConfigError(f"offload_folder={short(offload_folder)} is of type {type(offload_folder).__name__}; allowed: a "
                          "directory path (str or pathlib.Path)")
    if offload_folder is not None and device_map is None:
        raise ConfigError(f"offload_folder {short(str(offload_folder))} only applies to a device_map (it holds the "
                          "weights of modules the map puts on disk); allowed: device_map='auto' (or another strategy, "
                          "or a map with 'disk' entries) with it, or no offload_folder")
    if offload_folder is None:
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ConfigError("device_map puts modules on disk but no offload_folder was given; allowed: "
                              "--offload-folder DIR (offload_folder=DIR)")
        return None
    path = Path(offload_folder)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"offload_folder {short(str(offload_folder))} exists and is not a directory; allowed: a "
                          "directory (it is created if missing)")
    if path.is_dir():  # accelerate writes <weight name>.dat files and index.json there: never over the user's files
        foreign = sorted(p.name for p in path.iterdir() if p.suffix != ".dat" and p.name != "index.json")
        if foreign:
            raise ConfigError(f"offload_folder {short(str(offload_folder))} holds other files ({short(foreign[0])}"
                              f"{' and more' if len(foreign) > 1 else ''}) that offloading could overwrite; allowed: "
                              "a new or empty directory, or one an earlier offload wrote")
    return str(path)


def _probe(bits: int, device: torch.device) -> None:
    """Quantize a few numbers with bitsandbytes on ``device`` (the kernels ``from_pretrained`` will call)."""
    import bitsandbytes.functional as bnbf

    sample = torch.randn(64, 64, device=device, dtype=torch.float16)
    if bits == 8:
        bnbf.int8_vectorwise_quant(sample)
    else:
        bnbf.quantize_4bit(sample, quant_type="nf4")


def quantization_config(bits: int, compute_dtype: torch.dtype, device: torch.device):
    """transformers' ``BitsAndBytesConfig`` for ``bits`` (8: LLM.int8; 4: NF4 computing in ``compute_dtype``),
    or ``None`` for 16, once bitsandbytes is known to run them on ``device`` here (checked before loading).

    bitsandbytes >= 0.45 has a CPU backend for LLM.int8 and NF4 (slow, but exact to its CUDA kernels' formats);
    older versions, or a build without this device's kernels, fail here with one message saying what would work.

    Raises:
        ModelLoadError: bitsandbytes missing, or without kernels for ``device``.
    """
    if bits == 16:
        return None
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ModelLoadError(
            f"weights_bits={bits} needs bitsandbytes; install it with: pip install 'bitsandbytes>=0.45'"
        ) from None
    try:
        _probe(bits, device)
    except Exception as exc:  # noqa: BLE001 - any failure of the probe means the load would fail the same way
        version = getattr(bitsandbytes, "__version__", "?")
        works = ("weights_bits=16, or a CUDA GPU (device cuda)" if device.type == "cpu" else
                 "weights_bits=16, or device cpu with bitsandbytes >= 0.45 (its CPU backend)")
        raise ModelLoadError(
            f"bitsandbytes {version} cannot run {bits}-bit weights on {device} here "
            f"({type(exc).__name__}: {str(exc).strip()[:150]}); what would work: {works}"
        ) from None
    from transformers import BitsAndBytesConfig

    if bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype)


def execution_device(module: torch.nn.Module) -> torch.device | None:
    """The device accelerate runs ``module`` on (its hook's ``execution_device``), else that of its first
    parameter that is not on ``meta``; ``None`` if neither exists."""
    hook = getattr(module, "_hf_hook", None)
    for one in getattr(hook, "hooks", [hook]):  # a SequentialHook holds several
        target = getattr(one, "execution_device", None)
        if target is not None:
            return torch.device("cuda", target) if isinstance(target, int) else torch.device(target)
    for param in module.parameters():
        if param.device.type != "meta":
            return param.device
    return None


def input_device(model) -> torch.device:
    """Where ``model`` expects its input ids: the execution device of its input embeddings (a model split by
    ``device_map`` starts there), else of the model itself, else CPU."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    for module in (embeddings, model):
        if isinstance(module, torch.nn.Module):
            device = execution_device(module)
            if device is not None:
                return device
    return torch.device("cpu")


def floating_dtype(model) -> torch.dtype:
    """The compute dtype of ``model``: its first floating-point parameter's (8/4-bit weights are integers)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def loaded_weight_bytes(model) -> int:
    """Bytes of a loaded model's weights: parameters and buffers (``get_memory_footprint``), plus what
    bitsandbytes keeps beside them: LLM.int8's per-row fp32 scales (``SCB``) and NF4's absmax (and nested
    quantization state). Offloaded (``meta``) parameters count at their size, wherever they are stored. Packed
    int8 CPU weights (`h2o_compress.models.int8_linear`) are buffers: their int8 weights and scales count here."""
    total = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    for param in model.parameters():
        scb = getattr(param, "SCB", None)
        if isinstance(scb, torch.Tensor):
            total += scb.numel() * scb.element_size()
        state = getattr(param, "quant_state", None)
        while state is not None:
            absmax = getattr(state, "absmax", None)
            if isinstance(absmax, torch.Tensor):
                total += absmax.numel() * absmax.element_size()
            state = getattr(state, "state2", None) if getattr(state, "nested", False) else None
    return total


def attention_devices(model, num_layers: int) -> list[torch.device]:
    """The device each attention layer runs on (the modules with an integer ``layer_idx``): its accelerate hook's
    execution device, else its weights' device, else the nearest enclosing module's; layers not found run on
    `input_device`. A cache layer's storage belongs there (e.g. when a saved cache is loaded)."""
    modules = dict(model.named_modules())
    found: dict[int, torch.device] = {}
    for name, module in modules.items():
        index = getattr(module, "layer_idx", None)
        if not is_integer(index) or index in found:
            continue
        parts = name.split(".") if name else []
        for cut in range(len(parts), -1, -1):
            device = execution_device(modules[".".join(parts[:cut])])
            if device is not None:
                found[index] = device
                break
    default = input_device(model)
    return [found.get(i, default) for i in range(num_layers)]


def avoid_cpu_4bit_repack(model) -> int:
    """Work around bitsandbytes 0.50's CPU NF4 fast path, which repacks a weight for AVX512-bf16 on its first
    inference forward and fails (``shape ... is invalid``) when the layer's ``in_features`` is not a multiple of
    the 4-bit block (64): such layers keep the generic CPU path (``support_avx512bf16_for_cpu = False``, the
    flag bitsandbytes sets from the CPU's features). Returns how many layers were switched."""
    switched = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        state = getattr(weight, "quant_state", None)
        if state is None or not getattr(module, "support_avx512bf16_for_cpu", False):
            continue
        if weight.device.type == "cpu" and module.in_features % state.blocksize:
            module.support_avx512bf16_for_cpu = False
            switched += 1
    return switched


def loaded_weights_bits(model) -> int:
    """Bits of a loaded model's Linear weights: 8 or 4 when bitsandbytes quantized them, 4 when its decoder layers
    are packed 4-bit for CPU (`h2o_compress.models.int4_linear`, the head int8), 8 when they are packed int8
    (`h2o_compress.models.int8_linear`), else the width of its floating dtype (16, or 32 for fp32)."""
    if any(isinstance(m, Int4Linear) for m in model.modules()):
        return 4
    if any(isinstance(m, Int8Linear) for m in model.modules()):
        return 8
    quant = getattr(getattr(model, "config", None), "quantization_config", None)
    if quant is not None:
        get = quant.get if isinstance(quant, dict) else lambda name, default=None: getattr(quant, name, default)
        if get("load_in_4bit", False):
            return 4
        if get("load_in_8bit", False):
            return 8
    return 8 * torch.empty((), dtype=floating_dtype(model)).element_size()


def eager_only_reason(model) -> str | None:
    """Why the decode step of ``model`` runs eagerly by default (``None``: no reason): bitsandbytes weights, or a
    model accelerate dispatched over several devices or with CPU/disk offload (its hooks move weights per
    forward, which transformers does not compile either)."""
    if any(isinstance(m, Int4Linear) for m in model.modules()):
        return "packed 4-bit CPU weights"
    if any(isinstance(m, Int8Linear) for m in model.modules()):
        return "packed int8 CPU weights"
    if loaded_weights_bits(model) in (8, 4):
        return "bitsandbytes weights"
    placed = {str(target) for target in (getattr(model, "hf_device_map", None) or {}).values()}
    if len(placed) > 1 or "disk" in placed:
        return "a model split or offloaded by device_map"
    return None

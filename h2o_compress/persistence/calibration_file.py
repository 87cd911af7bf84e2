"""The calibration file: what `h2o-compress calibrate` fits once per model, in one safetensors file.

Tensors (fp32): ``eviction.weights`` ``[layers, kv_heads, head_dim + 4]``, the calibrated policy's weights per
layer and KV head (`h2o_compress.policies.CalibratedPolicy`); ``keys.channel_mean`` ``[layers, kv_heads, head_dim]``,
the mean pre-RoPE key per layer and KV head (`h2o_compress.calibration.key_channels.key_channel_statistics`), which
``key_offsets="calibrated"`` subtracts before 4- or 8-bit keys are quantized; absent where the model has no fixed
rotary embedding (a file written before it existed has none either). Other tensors are kept as they are. Metadata (strings): ``format`` (`FORMAT`), ``format_version``,
``library_version``, ``model_fingerprint`` (the model it was fitted on:
`h2o_compress.models.identity.model_fingerprint`), ``model_id``, ``details`` (JSON: the calibration text, tokens,
label, held-back figures) and ``checksum`` (as a cache file's). The file is written atomically, like a cache.

A cache reads it when it is made (`calibration_for`): the policy's weights per layer, and with
``key_offsets="calibrated"`` the mean keys its layers store their keys around (`use_key_offsets`). Every file read is
checked first (`read_calibration`: real floating-point, finite, bounded tensors; metadata of bounded size and depth)
and against the model it is used with (`load_calibration`: layers, KV heads, columns). The checksum finds damage; it
authenticates nothing: what is trusted is the file's location (the cache root's private ``calibration/`` directory).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from h2o_compress.formats.calibrated import CalibratedKeyQuantizer, key_shape, rope_frequencies
from h2o_compress.formats.integer import IntQuantizer
from h2o_compress.models import model_dims
from h2o_compress.models.identity import model_fingerprint, model_identity
from h2o_compress.persistence.file_format import _checksum, write_checksummed
from h2o_compress.utils.checks import check_flag
from h2o_compress.utils.errors import CacheFileError, ConfigError, one_line, short
from h2o_compress.utils.files import check_path
from h2o_compress.utils.paths import check_private, private_dir
from h2o_compress.utils.version import __version__

FORMAT = "h2o-compress-calibration"
FORMAT_VERSION = "1"
#: The tensor holding the calibrated eviction policy's weights.
EVICTION_WEIGHTS = "eviction.weights"
#: The tensor holding the mean pre-RoPE key per layer and KV head (``key_offsets="calibrated"``).
KEY_CHANNEL_MEAN = "keys.channel_mean"
MAKE_ONE = "make one with: h2o-compress calibrate --model MODEL"
#: The largest magnitude a calibration tensor may hold: fitted weights and mean keys lie orders of magnitude below
#: it (SmolLM2-135M's: under 20); beyond it a ranking or a key offset overflows fp32/fp16 arithmetic.
MAX_MAGNITUDE = 1e6
#: The most characters of one metadata value (the ``details`` JSON among them).
MAX_METADATA_CHARS = 65_536
#: The most levels of nesting of ``details`` (``calibrate`` writes 1).
MAX_DETAILS_DEPTH = 8
#: Columns of a layer's eviction weights besides the value's: score, age, log norm, bias
#: (`h2o_compress.policies.calibrated.EXTRA_COLUMNS`).
EXTRA_COLUMNS = 4


@dataclass
class Calibration:
    """A calibration file's contents.

    Attributes:
        tensors: name -> fp32 CPU tensor (`EVICTION_WEIGHTS` ``[layers, kv_heads, head_dim + 4]``,
            `KEY_CHANNEL_MEAN` ``[layers, kv_heads, head_dim]``, ...).
        model_fingerprint: the fingerprint of the model it was fitted on.
        model_id: that model's name.
        details: what the fit used and measured (calibration text, tokens, label, held-back figures).
        layer_heads: the KV heads of each layer of the model it was checked against (`load_calibration`; a model
            whose layers differ in KV heads has its weights padded to the most), or ``None`` (not checked).
    """

    tensors: dict[str, torch.Tensor]
    model_fingerprint: str
    model_id: str
    details: dict = field(default_factory=dict)
    layer_heads: list[int] | None = None

    def eviction_weights(self, layer: int) -> torch.Tensor | None:
        """fp32 ``[kv_heads, head_dim + 4]`` of model layer ``layer`` (its own KV heads where `layer_heads` is
        known), or ``None`` where the file has none."""
        weights = self.tensors.get(EVICTION_WEIGHTS)
        if weights is None or layer >= weights.shape[0]:
            return None
        heads = self.layer_heads[layer] if self.layer_heads and layer < len(self.layer_heads) else None
        return weights[layer] if heads is None else weights[layer, :heads]

    def key_channel_mean(self) -> torch.Tensor | None:
        """fp32 ``[layers, kv_heads, head_dim]``: the mean pre-RoPE key per layer and KV head (`KEY_CHANNEL_MEAN`),
        or ``None`` where the file has none (a model without a fixed rotary embedding, or an older file)."""
        return self.tensors.get(KEY_CHANNEL_MEAN)


def check_calibration_target(path, overwrite: bool = False) -> Path:
    """The path a calibration file will be written to, checked before anything is computed.

    Raises:
        CacheFileError: not a path (or one with a NUL character), a missing directory, something that is not a
            regular file, or an existing file without ``overwrite``.
    """
    check_flag("overwrite", overwrite, error=CacheFileError)
    target = Path(check_path(path, "calibration file", CacheFileError))
    if "\x00" in str(target):
        raise CacheFileError(f"calibration file {short(str(target))} holds a NUL character; allowed: a file path")
    if not target.parent.is_dir():
        raise CacheFileError(f"directory {short(str(target.parent))} does not exist; allowed: a path in an existing "
                             "directory")
    if target.exists() and (not target.is_file() or target.is_symlink()):
        raise CacheFileError(f"{short(str(target))} is not a regular file; allowed: a new path or a file")
    if target.exists() and not overwrite:
        raise CacheFileError(f"{short(str(target))} exists; allowed: a new path, or --overwrite to replace it")
    return target


def save_calibration(path, calibration: Calibration, overwrite: bool = False) -> Path:
    """Write ``calibration`` to ``path`` atomically.

    Raises:
        CacheFileError: ``path`` exists and ``overwrite`` is not True, its directory is missing, or the write failed.
    """
    target = check_calibration_target(path, overwrite)
    tensors = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in calibration.tensors.items()}
    metadata = {"format": FORMAT, "format_version": FORMAT_VERSION, "library_version": __version__,
                "model_fingerprint": calibration.model_fingerprint, "model_id": calibration.model_id,
                "details": json.dumps(calibration.details, sort_keys=True)}
    return write_checksummed(target, metadata, tensors, "calibration file")


def read_calibration(path) -> Calibration:
    """Read and verify a calibration file, for any model: format, version, checksum, then what it may hold,
    whatever its checksum says: metadata of bounded size and nesting (`_check_details`), and real floating-point
    tensors whose values are finite and at most `MAX_MAGNITUDE` in magnitude. The checksum (a SHA-256 of the contents, stored in the file) finds a truncated or damaged
    file; it authenticates nothing (whoever can write the file can write a matching checksum): what is trusted is
    the file's location, as for the cache directory's kernels.

    Raises:
        CacheFileError: a missing or unreadable file, another format or version, a failed checksum, or contents
            that no calibration holds (one line naming the file, the tensor or metadata key and what is allowed).
    """
    source = Path(check_path(path, "calibration file", CacheFileError))
    if "\x00" in str(source) or not source.is_file():
        raise CacheFileError(f"calibration file {short(str(source))} does not exist; {MAKE_ONE}")
    try:
        with safe_open(str(source), framework="pt", device="cpu") as handle:
            metadata = dict(handle.metadata() or {})
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError, TypeError) as exc:
        raise CacheFileError(f"calibration file {short(str(source))} is truncated or not a safetensors file "
                             f"({one_line(str(exc), 200)})") from None
    if metadata.get("format") != FORMAT or metadata.get("format_version") != FORMAT_VERSION:
        raise CacheFileError(f"{short(str(source))} is not an h2o-compress calibration file of version "
                             f"{FORMAT_VERSION}; {MAKE_ONE}")
    if metadata.get("checksum") != _checksum(metadata, tensors):
        raise CacheFileError(f"calibration file {short(str(source))} fails its checksum: it was truncated or modified")
    name = short(str(source))
    details = _check_details(metadata, name)
    for key, tensor in tensors.items():
        if not tensor.dtype.is_floating_point:  # ints, bool, complex
            raise CacheFileError(f"calibration file {name}: tensor {short(key)} is of dtype "
                                 f"{str(tensor.dtype).removeprefix('torch.')}; allowed: real floating-point tensors "
                                 f"({MAKE_ONE})")
        values = tensor.float()
        if not bool(torch.isfinite(values).all()):
            raise CacheFileError(f"calibration file {name}: tensor {short(key)} holds NaN or Inf; allowed: finite "
                                 f"values (run h2o-compress calibrate again: {MAKE_ONE})")
        largest = float(values.abs().max()) if values.numel() else 0.0
        if largest > MAX_MAGNITUDE:
            raise CacheFileError(f"calibration file {name}: tensor {short(key)} holds values up to {largest:.3g} in "
                                 f"magnitude; allowed: at most {MAX_MAGNITUDE:.0e} (a fit gives far less: "
                                 f"{MAKE_ONE})")
    return Calibration({k: v.float() for k, v in tensors.items()}, metadata.get("model_fingerprint", ""),
                       metadata.get("model_id", ""), details)


def _depth(value) -> int:
    """Levels of nesting of a parsed JSON ``value`` (a scalar: 0), counted without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _check_details(metadata: dict[str, str], name: str) -> dict:
    """The ``details`` of a calibration file's ``metadata``, parsed, after its metadata sizes are checked.

    Raises:
        CacheFileError: a metadata value over `MAX_METADATA_CHARS`, or ``details`` that is not a JSON object of at
            most `MAX_DETAILS_DEPTH` levels.
    """
    for key, value in metadata.items():
        if len(value) > MAX_METADATA_CHARS:
            raise CacheFileError(f"calibration file {name}: metadata {short(key)} holds {len(value):,} characters; "
                                 f"allowed: at most {MAX_METADATA_CHARS:,} ({MAKE_ONE})")
    try:
        details = json.loads(metadata.get("details", "{}"))
    except (ValueError, RecursionError):
        details = None
    if not isinstance(details, dict) or _depth(details) > MAX_DETAILS_DEPTH:
        raise CacheFileError(f"calibration file {name}: its details are not a JSON object of at most "
                             f"{MAX_DETAILS_DEPTH} levels; allowed: a file written by h2o-compress calibrate "
                             f"({MAKE_ONE})")
    return details


def default_calibration_path(model) -> Path:
    """Where `h2o-compress calibrate` writes ``model``'s calibration when no ``--out`` is given, and where a cache
    looks for it when no ``calibration`` is set: ``<cache root>/calibration/<model fingerprint>.safetensors`` (a
    directory only this user can write, `h2o_compress.utils.paths.private_dir`).

    Raises:
        ConfigError: the cache root is unusable.
    """
    return private_dir("calibration") / f"{model_fingerprint(model)}.safetensors"


def calibration_for(config, model) -> Calibration | None:
    """The calibration a cache of ``config`` for ``model`` uses: the file ``config.calibration`` names; else, where
    the policy needs one or ``config.key_offsets`` is ``"calibrated"``, the model's own file
    (`default_calibration_path`, what ``calibrate`` writes) or the one shipped for it (`shipped_calibration_path`);
    else ``None``.

    Raises:
        ConfigError: the policy needs a calibration (``needs_calibration``) and would evict, or the keys are
            calibrated, and none is given or found (naming the command that makes one).
        CacheFileError: as `load_calibration`.
    """
    if config.calibration is not None:
        return load_calibration(config.calibration, model)
    keys = getattr(config, "key_offsets", "none") == "calibrated"
    if not keys and (not config.eviction_policy().needs_calibration or not config.evicts_any):
        return None
    path = default_calibration_path(model)
    if path.is_file():
        check_private(path, "file")
        return load_calibration(path, model)
    shipped = shipped_calibration_path(model)
    if shipped is not None:
        return load_calibration(shipped, model)
    needs = "key_offsets='calibrated'" if keys else f"policy={config.policy!r}"
    raise ConfigError(f"{needs} needs a calibration of this model ({model_identity(model)}) and "
                      f"none was found at {short(str(path))}; allowed: run h2o-compress calibrate --model MODEL "
                      "once (minutes), or give --calibration FILE")


def shipped_calibration_path(model) -> Path | None:
    """The calibration shipped with the package for ``model`` (``h2o_compress/data/calibration/<fingerprint>
    .safetensors``: the embedded SmolLM2-135M's, fitted on the tuning text), or ``None``."""
    path = Path(str(resources.files("h2o_compress").joinpath("data", "calibration",
                                                             f"{model_fingerprint(model)}.safetensors")))
    return path if path.is_file() else None


def layer_geometry(model) -> list[tuple[int, int]]:
    """``(kv_heads, value_dim)`` of each layer's cache, as the calibration file holds them: read from each
    layer's attention module where every layer has ``k_proj`` and ``v_proj`` linear layers (a model whose layers
    differ, MiMo-V2's sliding layers with twice the KV heads), else (and for a hybrid, whose linear-attention /
    SSM / convolution layers may have projections of their own) from the config
    (`h2o_compress.models.model_dims`: a latent cache's one head, the value head dim where it differs).

    Raises:
        UnsupportedModelError: as `h2o_compress.models.model_dims` (layer types the cache does not take).
    """
    dims = model_dims(model.config)
    heads, value_dim = dims.kv_heads, dims.value_head_dim or dims.head_dim
    if any(span.stateful for span in dims.spans):  # a hybrid: its state layers' projections hold no KV cache
        return [(heads, value_dim)] * dims.num_layers
    modules = [m for m in model.modules()
               if isinstance(getattr(m, "k_proj", None), torch.nn.Linear)
               and isinstance(getattr(m, "v_proj", None), torch.nn.Linear)]
    if len(modules) != dims.num_layers:
        return [(heads, value_dim)] * dims.num_layers
    geometry = []
    for module in modules:
        keys, values = module.k_proj.out_features, module.v_proj.out_features
        layer_heads = keys // dims.head_dim if keys % dims.head_dim == 0 else heads
        geometry.append((layer_heads, values // layer_heads if values % layer_heads == 0 else value_dim))
    return geometry


def _mismatch(got: tuple, want: tuple, names: tuple[str, ...]) -> str:
    """What differs between shapes ``got`` and ``want`` (named dimension by dimension), in words."""
    if len(got) != len(want):
        return f"a tensor of shape {list(got)}, not [{', '.join(names)}] = {list(want)}"
    return ", ".join(f"{g} {name} (this model: {w})" for g, w, name in zip(got, want, names) if g != w)


def load_calibration(path, model) -> Calibration:
    """`read_calibration`, refused unless it was fitted on ``model`` (the same fingerprint, as a saved cache is)
    and its tensors fit the model, before any cache is built: the eviction weights must be ``[layers, kv_heads,
    value head_dim + 4]`` and the mean keys (where present) ``[layers, kv_heads, head_dim]``, of this model
    (`layer_geometry`). Sets ``calibration.layer_heads``.

    Raises:
        CacheFileError: as `read_calibration`, a file fitted on another model (naming what differs: its name and
            geometry, or, where those are alike, its weights or config), no eviction weights, or a tensor of
            another shape (naming the file and what differs).
        UnsupportedModelError: as `layer_geometry`.
    """
    calibration = read_calibration(path)
    if calibration.model_fingerprint != model_fingerprint(model):
        theirs, ours = calibration.model_id or "another model", model_identity(model)
        differs = (f"{theirs}, not {ours}" if theirs != ours else
                   f"a model of the same name and geometry ({ours}) with other weights or config (fingerprint "
                   f"{short(calibration.model_fingerprint[:12])}, this model's {model_fingerprint(model)[:12]})")
        raise CacheFileError(f"calibration file {short(str(path))} was fitted on {differs}; allowed: a file "
                             f"calibrated on this model ({MAKE_ONE})")
    geometry = layer_geometry(model)
    name, again = short(str(path)), f"allowed: a file calibrated on this model ({MAKE_ONE})"
    weights = calibration.tensors.get(EVICTION_WEIGHTS)
    if weights is None:
        raise CacheFileError(f"calibration file {name} holds no {EVICTION_WEIGHTS}; {again}")
    want = (len(geometry), max(h for h, _ in geometry), max(d for _, d in geometry) + EXTRA_COLUMNS)
    if tuple(weights.shape) != want:
        differs = _mismatch(tuple(weights.shape), want, ("layers", "KV heads", "columns"))
        raise CacheFileError(f"calibration file {name}: its {EVICTION_WEIGHTS} have {differs}; {again}")
    mean = calibration.key_channel_mean()
    key_want = (len(geometry), *key_shape(model))
    if mean is not None and tuple(mean.shape) != key_want:
        differs = _mismatch(tuple(mean.shape), key_want, ("layers", "KV heads", "head_dim"))
        raise CacheFileError(f"calibration file {name}: its {KEY_CHANNEL_MEAN} have {differs}; {again}")
    calibration.layer_heads = [h for h, _ in geometry]
    return calibration


def calibrate_key_layers(layers, model, mean: torch.Tensor) -> None:
    """Switch fresh cache ``layers`` (one per model layer, in order) to keys stored around ``mean`` (fp32
    ``[layers, kv_heads, head_dim]``, rotated to each token's position: `CalibratedKeyQuantizer`). Every layer is
    checked before any changes.

    Raises:
        ConfigError: ``mean`` of another shape than the model's layers, KV heads and head_dim; a layer whose keys
            are not 4- or 8-bit ``int``, that pools its heads, keeps 8-bit planes, or holds tokens.
        UnsupportedModelError: no fixed RoPE (`h2o_compress.formats.calibrated.rope_frequencies`).
    """
    layers = list(layers)
    heads, head_dim = key_shape(model)
    if not isinstance(mean, torch.Tensor) or tuple(mean.shape) != (len(layers), heads, head_dim):
        raise ConfigError(f"key_channel_mean must be a [{len(layers)}, {heads}, {head_dim}] tensor (layers, KV heads, "
                          "head_dim of the model); got "
                          f"{tuple(mean.shape) if isinstance(mean, torch.Tensor) else type(mean).__name__}")
    inv_freq, scaling = rope_frequencies(model)
    settings = []
    for layer, layer_mean in zip(layers, mean):
        quantizer, setting = layer.setting.key_quantizer, layer.setting
        if type(quantizer) is not IntQuantizer or setting.head_adaptive or setting.high_bits_fraction > 0 \
                or layer.is_initialized:
            raise ConfigError(f"layer {layer.layer_idx} cannot take a key calibration; allowed: a fresh cache with "
                              "4- or 8-bit int keys, head_budgets='uniform', high_bits_fraction=0")
        calibrated = CalibratedKeyQuantizer(quantizer.bits, quantizer.group_size, quantizer.head_dim, layer_mean,
                                            inv_freq, quantizer.rotate, scaling)
        settings.append(dataclasses.replace(setting, key_quantizer=calibrated))
    for layer, setting in zip(layers, settings):  # every layer checked first: all or none change
        layer.setting = setting


def use_key_offsets(layers, config, model, calibration) -> None:
    """What ``make_cache`` does with ``config.key_offsets``: with ``"calibrated"``, ``layers`` store their keys
    around ``calibration``'s mean pre-RoPE keys (`calibrate_key_layers`); with ``"none"``, nothing.

    Raises:
        ConfigError: the calibration (a [`Calibration`][h2o_compress.persistence.Calibration], or ``None``) holds no
            key statistics (naming the command that writes them), or as `calibrate_key_layers`.
        UnsupportedModelError: as `calibrate_key_layers`.
    """
    if getattr(config, "key_offsets", "none") != "calibrated":
        return
    mean = None if calibration is None else calibration.key_channel_mean()
    if mean is None:
        name = getattr(calibration, "model_id", "") or "this model"
        raise ConfigError(f"key_offsets='calibrated' needs the mean pre-RoPE keys of {name} and its calibration file "
                          "has none (written before they were measured, or a model without a fixed rotary embedding); "
                          "allowed: rerun h2o-compress calibrate --model MODEL, or key_offsets 'none'")
    calibrate_key_layers(layers, model, mean)

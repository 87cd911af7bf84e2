"""`StorageSpec`: how a setting stores its keys and values (bits, format, groups, full-precision window, rotation,
8-bit share and key offsets), checked on its own.

[`CompressionConfig`][h2o_compress.config.CompressionConfig] holds one as ``config.storage`` and reads its fields as
flat settings (``config.kv_bits``; its keywords, config files, CLI flags and saved caches name them so). The
storage fields are checked here, once, and what a format supports is read from its class
(`h2o_compress.formats.FORMATS`: ``supported_bits``, ``rotates``, ``mixed_precision``, ``compilable``). What
combines storage with the other parts (the decode kernel, the head layout) the config checks.
"""

from __future__ import annotations

from dataclasses import dataclass

from h2o_compress.formats import FORMATS, GROUP_SIZES
from h2o_compress.utils.checks import check_count, check_flag, check_number
from h2o_compress.utils.errors import ConfigError, short

#: Bit widths keys and values may be stored in: 16 (not quantized) and those a format stores (its
#: ``supported_bits``): 4, 8, 16.
ALLOWED_BITS = tuple(sorted({16}.union(*(family.supported_bits for family in FORMATS.values()))))
#: ``key_offsets``: ``none``, or keys stored around a calibrated mean (KVQuant).
KEY_OFFSETS = ("none", "calibrated")
MAX_RESIDUAL = 4096  # a full-precision window longer than this is no longer compression


def key_offsets_conflict(what: str, allowed: str) -> ConfigError:
    """The error for ``key_offsets='calibrated'`` with a setting it does not work with (``what``), naming what is
    ``allowed``; used here and by the config for the conflicts with the other parts."""
    return ConfigError(f"key_offsets='calibrated' stores 4- or 8-bit int keys around a calibrated mean, "
                       f"but {what}; allowed: {allowed}, or key_offsets 'none'")


@dataclass(frozen=True)
class StorageSpec:
    """How keys and values are stored (``CompressionConfig.storage``); checked when made.

    Args:
        kv_bits: bits of stored keys and values: 16 (default, no quantization), 8 or 4.
        k_bits: bits of the keys (4, 8, 16), over ``kv_bits``; ``None`` (default): ``kv_bits``.
        v_bits: bits of the values (4, 8, 16), over ``kv_bits``; ``None`` (default): ``kv_bits``.
        quant: the format: ``int`` (default), ``nf4``, ``fp4`` or ``int8-blockwise`` (a key of
            `h2o_compress.formats.FORMATS`).
        group_size: elements of ``head_dim`` sharing one scale and zero point: 32 (default), 64 or 128
            (`h2o_compress.formats.GROUP_SIZES`).
        residual: newest tokens kept in full precision (default 3), 0 to `MAX_RESIDUAL`, each quantized once as it
            leaves.
        rotate: Hadamard-rotate ``head_dim`` before quantization (default True; formats that declare ``rotates``:
            ``int``).
        high_bits_fraction: share in [0, 1] of a layer's stored 4-bit tokens kept at 8 bits (default 0: off; a
            format that declares ``mixed_precision``). Here, not in the layout: it is a second precision of the
            stored tokens.
        key_offsets: ``none`` (default) or ``calibrated`` (4- or 8-bit ``int`` keys around a calibrated mean, not
            with ``high_bits_fraction``). Here: it changes how keys are stored.

    Raises:
        ConfigError: the first value out of range or unsupported by the format, naming it and what is allowed.
    """

    kv_bits: int = 16
    k_bits: int | None = None
    v_bits: int | None = None
    quant: str = "int"
    group_size: int = 32
    residual: int = 3
    rotate: bool = True
    high_bits_fraction: float = 0.0
    key_offsets: str = "none"

    def __post_init__(self) -> None:
        self._check_bits()
        if type(self.group_size) is not int or self.group_size not in GROUP_SIZES:
            raise ConfigError(f"group_size={short(self.group_size)} is not supported; allowed: "
                              f"{', '.join(map(str, GROUP_SIZES))}")
        check_count("residual", self.residual, minimum=0, maximum=None)
        if self.residual > MAX_RESIDUAL:
            raise ConfigError(
                f"residual={short(self.residual)} is too large: the window stays in full precision, so nothing would be "
                f"quantized; allowed: an integer from 0 to {MAX_RESIDUAL} (tokens)"
            )
        check_flag("rotate", self.rotate)
        self._check_high_bits()
        self._check_key_offsets()

    def _check_bits(self) -> None:
        """``kv_bits`` / ``k_bits`` / ``v_bits``, ``quant``, and the bits ``quant``'s format stores."""
        for name in ("kv_bits", "k_bits", "v_bits"):
            value = getattr(self, name)
            if value is None and name != "kv_bits":
                continue
            if type(value) is not int or value not in ALLOWED_BITS:
                raise ConfigError(f"{name}={short(value)} is not supported; allowed: "
                                  f"{', '.join(map(str, ALLOWED_BITS))}")
        if not isinstance(self.quant, str) or self.quant not in FORMATS:
            raise ConfigError(f"unknown quant backend {short(self.quant)}; allowed: {', '.join(FORMATS)}")
        stored = self.format.supported_bits
        for bits in {self.key_bits, self.value_bits} - {16} - set(stored):
            width = "/".join(map(str, stored))
            article = "an" if width.startswith("8") else "a"
            raise ConfigError(f"quant={self.quant!r} is {article} {width}-bit format, not {bits}-bit; allowed kv bits with it: "
                              f"{', '.join(map(str, (*stored, 16)))}")

    def _check_high_bits(self) -> None:
        """``high_bits_fraction``: a number in [0, 1]; above 0 only with 4-bit keys or values of a format that
        declares ``mixed_precision``."""
        fraction = check_number("high_bits_fraction", self.high_bits_fraction, "a number in [0, 1]")
        if not 0 <= fraction <= 1:
            raise ConfigError(f"high_bits_fraction={short(self.high_bits_fraction)} is out of range; allowed: [0, 1]")
        if fraction > 0 and (not self.format.mixed_precision or 4 not in (self.key_bits, self.value_bits)):
            raise ConfigError(
                f"high_bits_fraction={fraction!r} keeps some 4-bit tokens at 8 bits, but keys are {self.key_bits}-bit "
                f"and values {self.value_bits}-bit with quant={self.quant!r}; allowed: kv_bits (or k_bits / v_bits) "
                "4 with quant 'int', or high_bits_fraction 0"
            )

    def _check_key_offsets(self) -> None:
        """``key_offsets``: ``none`` or ``calibrated``; ``calibrated`` only with 4- or 8-bit ``int`` keys and no
        8-bit share (``high_bits_fraction`` 0)."""
        if not isinstance(self.key_offsets, str) or self.key_offsets not in KEY_OFFSETS:
            raise ConfigError(f"key_offsets={short(self.key_offsets)} is not supported; allowed: "
                              f"{', '.join(KEY_OFFSETS)}")
        if self.key_offsets == "none":
            return
        if self.key_bits == 16 or self.quant != "int":
            raise key_offsets_conflict(f"keys are {self.key_bits}-bit with quant={self.quant!r}",
                                       "kv_bits (or k_bits) 4 or 8 with quant 'int'")
        if self.high_bits_fraction > 0:
            raise key_offsets_conflict(f"high_bits_fraction={self.high_bits_fraction!r}", "high_bits_fraction 0")

    @property
    def key_bits(self) -> int:
        """Bits of stored keys (``k_bits`` if set, else ``kv_bits``)."""
        return self.k_bits if self.k_bits is not None else self.kv_bits

    @property
    def value_bits(self) -> int:
        """Bits of stored values (``v_bits`` if set, else ``kv_bits``)."""
        return self.v_bits if self.v_bits is not None else self.kv_bits

    @property
    def format(self):
        """The format family of ``quant`` (a [`KVQuantizer`][h2o_compress.formats.KVQuantizer] class)."""
        return FORMATS[self.quant]

    @property
    def quantized(self) -> bool:
        """True when keys or values are stored below 16 bits."""
        return min(self.key_bits, self.value_bits) < 16

    @property
    def compilable(self) -> bool:
        """Whether the decode step can be traced by ``torch.compile``: 16 bits, or a format that declares it
        (``compilable``)."""
        return not self.quantized or self.format.compilable


DEFAULT_QUANT = StorageSpec.quant  # the default format: giving it changes nothing


def check_format_options(storage, given) -> None:
    """Refuse storage-format options the user gave (``given``: the setting names set on the command line or in a
    config file) that the bits of ``storage`` (a `StorageSpec`, or a config that reads as one) make moot, so they
    would be ignored silently: ``quant`` other than ``int`` or ``rotate`` with 16-bit keys and values (nothing is
    quantized), and ``rotate`` with a bitsandbytes format (it rotates before ``int`` quantization only). The CLI
    skips this where the planner picks the bits (``generate --memory-limit``) or a loaded cache brings its own
    setting (``--load-cache``).

    Raises:
        ConfigError: naming the option, the bits and what is allowed.
    """
    unquantized = storage.key_bits == 16 and storage.value_bits == 16
    if "quant" in given and storage.quant != DEFAULT_QUANT and unquantized:
        raise ConfigError(
            f"quant={storage.quant!r} quantizes nothing with 16-bit keys and values, so it would be ignored; allowed: "
            "kv_bits 4 or 8 (or k_bits / v_bits) with it"
        )
    if "rotate" in given and storage.rotate and (unquantized or not storage.format.rotates):
        reason = "16-bit keys and values" if unquantized else f"quant={storage.quant!r}"
        rotating = ", ".join(repr(name) for name, family in FORMATS.items() if family.rotates)
        raise ConfigError(
            f"rotate=True rotates before int quantization, which {reason} does not run, so it would be ignored; "
            f"allowed: rotate with kv_bits 4 or 8 and quant {rotating}, or rotate False"
        )

"""`QuantizeConfig`: the per-layer quantization settings.

What each layer type gets by default (weights, axes, input placement) is
its row in `keras_mp.layer_table`; a `QuantizeConfig` overrides it for the
layers it is given to.
"""

import dataclasses
import warnings

import keras

from keras_mp.quantization.formats import FORMATS
from keras_mp.quantization.names import canonical_name

# The precisions a layer can be quantized to: the `FORMATS` rows TensorRT
# runs, weights and inputs; the precision search and sensitivity analysis
# choose among these.
PRECISIONS = ("int8", "float8")
# The block-scaled precisions (int4 is the int4 row's blocked form, weight
# only; nvfp4 and mxfp8 quantize inputs too unless `weights_only`):
# `QuantizeConfig` takes them; the precision search does not yet.
BLOCK_PRECISIONS = ("int4", "nvfp4", "mxfp8")
# `block_size` not given: the precision's first block size if it has a
# block-scaled form (int4, nvfp4, mxfp8), else None.
_DEFAULT_BLOCK = "default"


def precision_name(precision, warn=True):
    """The `FORMATS` row name of `precision`, given in any case or in an
    old spelling (`"INT8"`; `"fp8"` or `"e4m3"` for `"float8"`, with a
    `DeprecationWarning` unless `warn` is False).

    Raises:
        ValueError: not a name of a format keras_mp quantizes to (the
            message lists them).
    """
    return canonical_name(precision, "precision", tuple(FORMATS), warn=warn)


@keras.saving.register_keras_serializable(package="keras_mp")
@dataclasses.dataclass(init=False)
class QuantizeConfig:
    """Per-layer quantization settings.

    Args:
        skip: bool. Leave the layer in float. Defaults to False.
        precision: str. `"int8"` or `"float8"` (FP8 E4M3, TensorRT on
            Ada, Hopper and newer): the number format of the layer's weights
            and inputs, a row of `keras_mp.quantization.FORMATS`. Any case
            is accepted; `"fp8"` and `"e4m3"` are old spellings of
            `"float8"` (a `DeprecationWarning`). `"int2"` ... `"int7"`:
            fewer int bits, for simulation (the export writes 8 bits
            only). Where
            TensorRT has no FP8 kernel (convolutions with 16 channels or
            fewer in or out, or a filter of more than 32 taps) the layer
            takes INT8 and `quantization_report` says so. `"int4"`: INT4
            weight-only (W4A16), for Dense and EinsumDense kernels: one
            float32 scale per `block_size` values along K and per output
            channel, inputs left in the layer's float dtype; convolutions
            and weights in a layer's own code take INT8, attention matmuls
            stay float (TensorRT runs INT4 on MatMul/Gemm weights only).
            `"nvfp4"` (E2M1 codes, FP8 scales per 16, Blackwell) and
            `"mxfp8"` (E4M3 codes, E8M0 scales per 32) are placed the same
            way, and quantize the Dense/EinsumDense input too (W4A4, W8A8),
            per block along K at run time as TensorRT's DynamicQuantize
            does (NVFP4's per-tensor input range from `keras_mp.calibrate`;
            exported with `dtype="float16"` or `"bfloat16"`). Defaults to
            `"int8"`.
        per_channel: bool. Per-channel weight ranges (on the output-channel
            axes); False for one range per weight tensor. Defaults to True.
        quantize_inputs: bool or None. Override the layer type's default
            input placement (e.g. True to quantize a pooling input). Defaults
            to None (the layer table's default).
        learned_range: bool. Train the activation ranges (PACT-style)
            instead of freezing them after calibration. Defaults to False.
        attention: bool. For `keras.layers.MultiHeadAttention` layers (and
            subclasses such as keras-hub's), keras-hub's attention layers
            and Keras' `GroupQueryAttention`, `Attention` and
            `AdditiveAttention`: Q/DQ on the inputs of the attention
            matmuls (scaled query and key; softmax output and value).
            False leaves those matmuls in float, as ModelOpt does for INT8
            above sequence length 512; the projections stay quantized.
            Defaults to True.
        dot: bool. For `keras.layers.Dot` layers (a DLRM's feature
            interactions): Q/DQ on both inputs of their matmul of two
            activations, after the l2-normalization of `normalize=True`.
            False leaves that matmul in float (a pairwise dot of two
            vectors is a GEMV, which ModelOpt's ONNX PTQ leaves in float).
            Defaults to True.
        small_gemms: bool. Quantize a Dense or EinsumDense whose GEMM has
            K or N below 16 (a 10-class head) too. TensorRT's INT8 and FP8
            kernels are no faster than float there and ModelOpt leaves
            them float, as keras_mp does by default. Defaults to False.
        block_size: int or None. For a block-scaled precision: values per
            block along K; int4: 128, 64 or 32 (TensorRT takes 64 and 128),
            nvfp4: 16, mxfp8: 32. K must be a multiple of it. None with
            `precision="int4"`: per-channel INT4 weights and inputs, for
            simulation (what `num_bits=4` gave). Defaults to the
            precision's first size (None for the other precisions).
        num_bits: int or None. Deprecated: the format is chosen by
            `precision` alone (`num_bits=4` is `precision="int4",
            block_size=None`, `num_bits=8` is `precision="int8"`); a
            `DeprecationWarning` names it. Saved configs holding it load
            silently. Defaults to None.
        weights_only: bool or None. For `"nvfp4"` and `"mxfp8"`: True
            quantizes the weights only (W4A16, W8A16), the input stays in
            the layer's float dtype. `"int4"` is always weight-only.
            Defaults to None (int4: True; nvfp4, mxfp8: False).

    Raises:
        ValueError: an unknown `precision`, `num_bits` not an integer in
            [2, 8] or naming another format than `precision`, or a
            `block_size` without a block-scaled precision or not one of
            its sizes, or `weights_only` with another precision than
            nvfp4 / mxfp8 (or False with int4).

    Example:

    >>> config = keras_mp.QuantizeConfig(per_channel=False)
    >>> qmodel = keras_mp.quantize_model(model, config={"fc": config})
    >>> fp8 = keras_mp.QuantizeConfig(precision="float8")
    >>> mixed = keras_mp.quantize_model(model, config={"encoder.*": fp8})
    >>> w4 = keras_mp.QuantizeConfig(precision="int4", block_size=64)
    """

    skip: bool = False
    per_channel: bool = True
    quantize_inputs: bool = None
    learned_range: bool = False
    attention: bool = True
    dot: bool = True
    precision: str = "int8"
    small_gemms: bool = False
    block_size: int = None
    weights_only: bool = None

    def __init__(
        self,
        skip=False,
        per_channel=True,
        quantize_inputs=None,
        learned_range=False,
        attention=True,
        dot=True,
        precision=None,
        small_gemms=False,
        block_size=_DEFAULT_BLOCK,
        num_bits=None,
        weights_only=None,
    ):
        self.skip = skip
        self.per_channel = per_channel
        self.quantize_inputs = quantize_inputs
        self.learned_range = learned_range
        self.attention = attention
        self.dot = dot
        self.small_gemms = small_gemms
        if num_bits is not None and precision is None:
            # num_bits=4 alone was per channel, not blocked
            block_size = None if block_size is _DEFAULT_BLOCK else block_size
        self.precision = _precision_of(precision, num_bits, warn=True)
        self.block_size = _block_size_of(self.precision, block_size)
        self.weights_only = _weights_only_of(
            self.precision, self.block_size, weights_only
        )

    @property
    def blocked(self):
        """Whether the precision is block-scaled (int4, nvfp4, mxfp8; not
        `precision="int4", block_size=None`, the per-channel int4 of
        simulation)."""
        return self.block_size is not None

    @property
    def block_inputs(self):
        """Whether a Dense/EinsumDense input is quantized in the block
        format too (nvfp4, mxfp8 without `weights_only`)."""
        return self.blocked and not self.weights_only

    @property
    def format(self):
        """The name of the `FORMATS` row of this config's quantizers: the
        precision."""
        return self.precision

    @property
    def num_bits(self):
        """The bits per value of the precision's format."""
        return FORMATS[self.precision].bits

    def get_config(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config):
        # Saved before the vocabulary (`names.py`): "fp8", or an int
        # precision spelled `precision="int8", num_bits=n`. Load silently.
        config = dict(config)
        num_bits = config.pop("num_bits", None)
        config["precision"] = _precision_of(
            config.get("precision"), num_bits, warn=False
        )
        # a file without `block_size` predates the blocked formats
        config.setdefault("block_size", None)
        return cls(**config)


def _precision_of(precision, num_bits, warn):
    """The precision of `precision` and the deprecated `num_bits`."""
    if precision is not None:
        precision = precision_name(precision, warn=warn)
    if num_bits is None:
        return precision or "int8"
    if (
        isinstance(num_bits, bool)
        or not isinstance(num_bits, int)
        or not 2 <= num_bits <= 8
    ):
        raise ValueError(
            "`num_bits` must be an integer in [2, 8] (TensorRT runs 8). "
            f"Received: num_bits={num_bits!r}"
        )
    by_bits = f"int{num_bits}"
    if not warn and precision not in (None, "int8"):
        return precision  # saved with its default num_bits=8
    if not warn:
        return by_bits  # saved as precision="int8", num_bits=n
    if precision is not None and FORMATS[precision].bits != num_bits:
        raise ValueError(
            "`precision` and `num_bits` name different formats: pass "
            f"`precision` alone. Received: precision={precision!r}, "
            f"num_bits={num_bits!r}"
        )
    by_bits = precision or by_bits
    spelled = f"precision={by_bits!r}"
    if by_bits == "int4" and precision is None:
        spelled += ", block_size=None"
    warnings.warn(
        "`QuantizeConfig(num_bits=)` is deprecated and will be removed in "
        "the next release: the format is chosen by `precision` alone; use "
        f"{spelled}.",
        DeprecationWarning,
        stacklevel=4,
    )
    return by_bits


def _weights_only_of(precision, block_size, weights_only):
    """`weights_only` checked against the precision: None for a format
    without blocks, the row's default when not given."""
    if block_size is None:
        if weights_only is not None:
            raise ValueError(
                "`weights_only` chooses between W4A4/W8A8 and weight-only "
                "for precision='nvfp4' or 'mxfp8' ('int4' is weight-only). "
                f"Received: precision={precision!r}, "
                f"weights_only={weights_only!r}"
            )
        return None
    row = FORMATS[precision]
    if weights_only is None:
        return row.weight_only
    if row.weight_only and not weights_only:
        raise ValueError(
            f"precision={precision!r} is weight-only on TensorRT: its "
            "inputs stay in the layer's float dtype. Received: "
            "weights_only=False"
        )
    return bool(weights_only)


def _block_size_of(precision, block_size):
    """`block_size` checked against `precision`'s block-scaled form."""
    row = FORMATS[precision]
    if block_size is _DEFAULT_BLOCK or (
        block_size is None and row.kind == "block"
    ):
        return row.block_sizes[0] if row.block else None
    if block_size is None:
        return None
    if not row.block:
        raise ValueError(
            "`block_size` is for the block-scaled precisions "
            f"({', '.join(repr(p) for p in BLOCK_PRECISIONS)}). Received: "
            f"precision={precision!r}, block_size={block_size!r}"
        )
    if block_size not in row.block_sizes:
        raise ValueError(
            f"precision={precision!r} takes block_size in "
            f"{list(row.block_sizes)} (TensorRT builds "
            f"{list(row.tensorrt_block_sizes)}). Received: "
            f"block_size={block_size!r}"
        )
    return block_size

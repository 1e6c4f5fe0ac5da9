"""`QuantizeConfig`: the per-layer quantization settings.

What each layer type gets by default (weights, axes, input placement) is
its row in `keras_mp.layer_table`; a `QuantizeConfig` overrides it for the
layers it is given to.
"""

import dataclasses

import keras

from keras_mp.quantization.formats import FORMATS

# The precisions a layer can be quantized to: the `FORMATS` rows TensorRT
# runs (int8 stands for the int rows of `num_bits`), weights and inputs;
# the precision search and sensitivity analysis choose among these.
PRECISIONS = ("int8", "fp8")
# The block-scaled precisions (int4 is the int4 row's blocked form, weight
# only; nvfp4 and mxfp8 quantize inputs too unless `weights_only`):
# `QuantizeConfig` takes them; the precision search does not yet.
BLOCK_PRECISIONS = ("int4", "nvfp4", "mxfp8")
# Other names of those precisions, lowercase: FP8 is E4M3 (TensorRT's FP8
# Q/DQ, the ONNX FLOAT8E4M3FN zero point).
_ALIASES = {
    "e4m3": "fp8",
    "e4m3fn": "fp8",
    "fp8_e4m3": "fp8",
    "float8_e4m3fn": "fp8",
}


def precision_name(precision):
    """The name in `PRECISIONS` or `BLOCK_PRECISIONS` of `precision`,
    given in any case or as an alias (`"INT8"`, `"FP8"`, `"e4m3"`,
    `"float8_e4m3fn"`).

    Raises:
        ValueError: not a name of a precision keras_mp quantizes to (the
            message lists them).
    """
    if isinstance(precision, str):
        key = precision.strip().lower()
        key = _ALIASES.get(key, key)
        if key in PRECISIONS + BLOCK_PRECISIONS:
            return key
    raise ValueError(
        f"`precision` must be one of {list(PRECISIONS + BLOCK_PRECISIONS)} "
        "(any case; FP8 is "
        f"E4M3, also named {', '.join(repr(a) for a in _ALIASES)}; fewer "
        "int bits: precision='int8' with num_bits). Received: "
        f"precision={precision!r}"
    )


@keras.saving.register_keras_serializable(package="keras_mp")
@dataclasses.dataclass
class QuantizeConfig:
    """Per-layer quantization settings.

    Args:
        skip: bool. Leave the layer in float. Defaults to False.
        precision: str. `"int8"` or `"fp8"` (FP8 E4M3, TensorRT on Ada,
            Hopper and newer): the number format of the layer's weights and
            inputs, a row of `keras_mp.quantization.FORMATS`. Any case is
            accepted, and `"e4m3"` for `"fp8"` (`precision_name`); the
            config keeps the lowercase name. Where
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
        num_bits: int. Bits of an int precision's weights and activations
            (2..8; TensorRT runs 8). Defaults to 8.
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
            nvfp4: 16, mxfp8: 32. K must be a multiple of it. Defaults to
            None (the precision's first size).
        weights_only: bool or None. For `"nvfp4"` and `"mxfp8"`: True
            quantizes the weights only (W4A16, W8A16), the input stays in
            the layer's float dtype. `"int4"` is always weight-only.
            Defaults to None (int4: True; nvfp4, mxfp8: False).

    Raises:
        ValueError: `num_bits` is not an integer in [2, 8], an unknown
            `precision`, `precision="fp8"` with `num_bits` other than 8,
            a `block_size` without a block-scaled precision or not one
            of its sizes, or `weights_only` with another precision than
            nvfp4 / mxfp8 (or False with int4).

    Example:

    >>> config = keras_mp.QuantizeConfig(per_channel=False)
    >>> qmodel = keras_mp.quantize_model(model, config={"fc": config})
    >>> fp8 = keras_mp.QuantizeConfig(precision="fp8")
    >>> mixed = keras_mp.quantize_model(model, config={"encoder.*": fp8})
    >>> w4 = keras_mp.QuantizeConfig(precision="int4", block_size=64)
    """

    skip: bool = False
    num_bits: int = 8
    per_channel: bool = True
    quantize_inputs: bool = None
    learned_range: bool = False
    attention: bool = True
    dot: bool = True
    precision: str = "int8"
    small_gemms: bool = False
    block_size: int = None
    weights_only: bool = None

    def __post_init__(self):
        if not isinstance(self.num_bits, int) or not 2 <= self.num_bits <= 8:
            raise ValueError(
                "`num_bits` must be an integer in [2, 8] (TensorRT runs 8). "
                f"Received: num_bits={self.num_bits!r}"
            )
        self.precision = precision_name(self.precision)
        if self.precision != "int8" and self.num_bits != 8:
            raise ValueError(
                f"`num_bits` is for int precisions; precision="
                f"{self.precision!r} has 8 bits. Received: "
                f"num_bits={self.num_bits!r}"
            )
        row = FORMATS[self.format]
        if self.weights_only is None and self.blocked:
            self.weights_only = row.weight_only
        if self.weights_only is not None and (
            not self.blocked or (row.weight_only and not self.weights_only)
        ):
            raise ValueError(
                "`weights_only` chooses between W4A4/W8A8 and weight-only "
                "for precision='nvfp4' or 'mxfp8' ('int4' is weight-only). "
                f"Received: precision={self.precision!r}, "
                f"weights_only={self.weights_only!r}"
            )
        if not self.blocked:
            if self.block_size is not None:
                raise ValueError(
                    "`block_size` is for the block-scaled precisions "
                    "('int4', 'nvfp4', 'mxfp8'). Received: precision="
                    f"{self.precision!r}, block_size={self.block_size!r}"
                )
        elif self.block_size is None:
            self.block_size = row.block_sizes[0]
        elif self.block_size not in row.block_sizes:
            raise ValueError(
                f"precision={self.precision!r} takes block_size in "
                f"{list(row.block_sizes)} (TensorRT builds "
                f"{list(row.tensorrt_block_sizes)}). Received: "
                f"block_size={self.block_size!r}"
            )

    @property
    def blocked(self):
        """Whether the precision is block-scaled (int4, nvfp4, mxfp8; not
        `num_bits=4`, the per-channel int4 of simulation)."""
        return (
            self.precision != "int8" and FORMATS[self.format].block is not None
        )

    @property
    def block_inputs(self):
        """Whether a Dense/EinsumDense input is quantized in the block
        format too (nvfp4, mxfp8 without `weights_only`)."""
        return self.blocked and not self.weights_only

    @property
    def format(self):
        """The name of the `FORMATS` row of this config's quantizers."""
        return (
            f"int{self.num_bits}"
            if self.precision == "int8"
            else self.precision
        )

    def get_config(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config):
        return cls(**config)

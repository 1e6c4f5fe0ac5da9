"""Number formats: what a quantizer rounds to, one row per format.

A `NumberFormat` holds everything that differs between formats: the grid
(`qmax`, `qmin`), its rounding function, and the element type the ONNX
export writes, and the TensorRT facts of the format (which convolutions
it runs, per-tensor convolution weights, a fixed softmax range). The
fake-quant math (`fake_quant.py`), the quantizer (`tensor_quantizer.py`), the
export, the placement (`placement.py`), the ONNX lint and the cost model
(`keras_mp.precision.cost`) read the row; none of them branches on a
format's name, so a new format is one row of `FORMATS`. Guide:
`docs/quantization.md` ("Number formats"); where each TensorRT fact
lives: `docs/architecture.md` ("TensorRT facts, each written once").
"""

import dataclasses
import types
from collections.abc import Callable

import ml_dtypes
import numpy as np
import tensorflow as tf

from keras_mp._switch import Switch
from keras_mp.quantization.blocks import block_format, exact_divide
from keras_mp.quantization.names import canonical_name

_TRACE = Switch(default=False)


def onnx_trace():
    """While active, quantizers compute their format's `carrier` (the Q/DQ
    tf2onnx can write) instead of its `qdq`: `export_onnx` traces the
    model inside it, then retypes the carriers (`keras_mp.onnx.retype`)."""
    return _TRACE.set(True)


def tracing():
    """Whether `onnx_trace` is active."""
    return _TRACE.value


_MARKERS = Switch(default={})


def dynamic_markers(markers):
    """While active, each block-scaled activation quantizer (NVFP4/MXFP8,
    `TensorQuantizer(dynamic_blocks=True)`) in `markers` (`{id(quantizer):
    float scale}`) traces as `dynamic_carrier`: `export_onnx` finds each
    carrier by its scale (`keras_mp.onnx.dynamic_blocks`)."""
    return _MARKERS.set(dict(markers))


def dynamic_carrier(quantizer, x):
    """The ONNX trace's stand-in for a block-scaled activation quantizer:
    an unsigned 8-bit Q/DQ (tf2onnx writes it) whose scale is the marker
    `dynamic_markers` gave `quantizer`, far below any quantizer's scale;
    the export replaces it by TensorRT's DynamicQuantize."""
    marker = _MARKERS.value.get(id(quantizer))
    if marker is None:
        raise ValueError(
            f"Quantizer {quantizer.name!r} quantizes an activation in "
            f"{quantizer.format.name!r}, which only `export_onnx` traces "
            "(it gives each such quantizer a marker)."
        )
    return tf.raw_ops.QuantizeAndDequantizeV3(
        input=x,
        input_min=tf.constant(0.0),
        input_max=tf.constant(marker * 255.0, tf.float32),
        num_bits=8,
        signed_input=False,
        range_given=True,
        narrow_range=False,
        axis=-1,
    )


@dataclasses.dataclass(frozen=True)
class NumberFormat:
    """A symmetric number format: its grid, rounding and ONNX type.

    A value `x` in a range `[-amax, amax]` is stored as the code
    `round(x / scale)` with `scale = amax / qmax`, saturated to
    `[qmin, qmax]` (`[-qmax, qmax]` for a narrow-range quantizer).

    Attributes:
        name: str. The row's name (`"int8"`), as configs save it.
        kind: str. `"int"` (uniform grid of integers), `"float"` (a
            floating-point grid, e.g. FP8 E4M3) or `"block"` (block-scaled
            only, NVFP4 and MXFP8: the `block` row holds the grid and the
            scales; no per-tensor or per-channel form).
        bits: int. Bits per value.
        qmax: float. The largest code; `amax` maps to it.
        qmin: float. The smallest code of the full range.
        onnx_type: str or None. The `onnx.TensorProto` element type of the
            exported zero point (TensorRT reads the format from it); None
            when the ONNX export cannot write this format.
        min_opset: int. The lowest ONNX opset with Q/DQ of `onnx_type`.
        storage: numpy dtype of the codes (`np.int8`,
            `ml_dtypes.float8_e4m3fn`): what an exported weight holds.
        qdq: callable `(fmt, x, amax, axis, narrow_range) -> tensor`. Rounds
            the float32 `x` to the grid of `fmt` scaled to `amax` (a scalar,
            or a vector along `axis`) and returns the grid values (no
            gradient: `fake_quant` adds it).
        carrier: callable like `qdq`, or None. For a format tf2onnx cannot
            write: what the ONNX trace computes instead (`onnx_trace`), an
            unsigned 8-bit Q/DQ whose scale is this format's; the export
            gives it `onnx_type`. None: the trace computes `qdq`.
        block: str or None. The `blocks.FORMATS` row of this format's
            block-scaled weights (`"int4"`: INT4 codes, one float32 scale
            per `block_size` values along K), which gives their ONNX types
            and opset; None when the format has no block-scaled form.
        block_sizes: tuple of int. The block sizes a quantizer accepts,
            default first (`()` without `block`).
        tensorrt_block_sizes: tuple of int. Those TensorRT builds.
        weight_only: bool. Block-scaled, TensorRT takes this format for
            weights only: the layer's activations stay in its float dtype.
        tensorrt_ops: tuple of str. The ONNX ops whose weights TensorRT
            takes block-scaled in this format (`()`: any weighted op).
        tensorrt: bool. TensorRT builds per-tensor and per-channel Q/DQ
            of `onnx_type` (`TENSORRT_QDQ_TYPES`, read by the lint).
        conv_min_channels: int. TensorRT runs a convolution in this format
            only with more channels than this in and out (a depthwise
            filter counts 1 input channel per group); 0: no limit.
        conv_max_taps: int or None. TensorRT runs a convolution in this
            format only with a filter of at most this many taps (spatial
            positions); None: no limit.
        conv_weights_per_tensor: bool. Convolution weights take one range
            per tensor (TensorRT documents per-channel weights of this
            format for GEMMs only); GEMM weights stay per channel.
        fixed_softmax_amax: float or None. The fixed range of a softmax
            output feeding an attention matmul (no calibration changes
            it), or None: calibrated like any activation.
        title: str or None. The format's name in messages, as TensorRT's
            documentation writes it (`"FP8"`); None: the name in capitals
            (`"INT8"`, `"NVFP4"`). Read it as `label`.
    """

    name: str
    kind: str
    bits: int
    qmax: float
    qmin: float
    onnx_type: str
    qdq: Callable = dataclasses.field(repr=False)
    storage: type = np.int8
    min_opset: int = 13
    carrier: Callable = dataclasses.field(default=None, repr=False)
    block: str = None
    block_sizes: tuple = ()
    tensorrt_block_sizes: tuple = ()
    weight_only: bool = False
    tensorrt_ops: tuple = ()
    tensorrt: bool = False
    conv_min_channels: int = 0
    conv_max_taps: int = None
    conv_weights_per_tensor: bool = False
    fixed_softmax_amax: float = None
    title: str = None

    def __post_init__(self):
        if self.kind not in ("int", "float", "block"):
            raise ValueError(
                f"NumberFormat {self.name!r}: `kind` must be 'int', 'float' "
                f"or 'block'. Received: kind={self.kind!r}"
            )
        if not self.qmin < 0 < self.qmax:
            raise ValueError(
                f"NumberFormat {self.name!r}: a symmetric format needs "
                f"qmin < 0 < qmax. Received: qmin={self.qmin}, "
                f"qmax={self.qmax}"
            )

    @property
    def label(self):
        """The format's name in messages: `title`, or the name in
        capitals."""
        return self.title or self.name.upper()

    @property
    def block_format(self):
        """The `blocks.BlockFormat` row of the block-scaled form, or None."""
        return None if self.block is None else block_format(self.block)

    @property
    def conv_limited(self):
        """Whether TensorRT runs only some convolutions in this format
        (`conv_min_channels`, `conv_max_taps`)."""
        return bool(self.conv_min_channels) or self.conv_max_taps is not None

    @property
    def narrow_qmin(self):
        """The smallest code of a narrow-range quantizer: `-qmax`."""
        return -self.qmax

    def scale(self, amax):
        """The Q/DQ scale of a range, `amax / qmax` in float32 (a scalar
        or one per channel)."""
        return np.asarray(amax, np.float32) / np.float32(self.qmax)

    def local_step(self, grid_values):
        """The distance between neighbouring codes at each magnitude, in
        units of the scale (numpy): 1 everywhere on an int grid; on a
        float grid, the spacing of the codes in the binade of
        `|grid_values|` (that of the subnormals below the smallest
        normal), e.g. 32 at 256..448 and 1/512 near 0 for FP8 E4M3."""
        magnitude = np.abs(np.asarray(grid_values, np.float64))
        if self.kind == "int":
            return np.ones_like(magnitude)
        info = ml_dtypes.finfo(self.storage)
        exponent = np.floor(np.log2(np.maximum(magnitude, float(info.tiny))))
        return np.exp2(exponent - info.nmant)

    def quantize_dequantize(self, x, amax, axis=None, narrow_range=False):
        """`x` rounded to this format's grid over `[-amax, amax]` (its
        `carrier` while `onnx_trace` is active)."""
        fn = self.qdq
        if self.carrier is not None and _TRACE.value:
            fn = self.carrier
        return fn(self, x, amax, axis, narrow_range)

    def encode(self, grid_values):
        """Codes of `storage` type for values already divided by the scale
        (numpy): rounded to the grid (half to even) and saturated."""
        clipped = np.clip(
            np.asarray(grid_values, np.float32), self.qmin, self.qmax
        )
        if self.kind == "int":
            clipped = np.rint(clipped)
        return clipped.astype(self.storage)


def _int_qdq(fmt, x, amax, axis, narrow_range):
    """TensorFlow's `QuantizeAndDequantizeV3` with a given range: round half
    to even, saturate; tf2onnx exports it as a QuantizeLinear /
    DequantizeLinear pair with a constant scale."""
    return tf.raw_ops.QuantizeAndDequantizeV3(
        input=x,
        input_min=-amax,
        input_max=amax,
        num_bits=fmt.bits,
        signed_input=True,
        range_given=True,
        narrow_range=narrow_range,
        axis=-1 if axis is None else axis,
    )


# INT4 weight-only, as TensorRT builds it (onnx-tensorrt `onnxOpImporters.cpp`
# DequantizeLinear: INT4 only as a blocked weight DQ, block size 64 or 128
# along K, symmetric; ModelOpt's INT4_AWQ / INT4_BLOCKWISE configs: scale
# `amax / 7`, blocks of 128, MatMul/Gemm weights only, inputs float).
# `blocks.py` also takes blocks of 32, for simulation and other runtimes.
_INT4_BLOCKS = dict(
    block="int4",
    block_sizes=(128, 64, 32),
    tensorrt_block_sizes=(128, 64),
    weight_only=True,
    tensorrt_ops=("MatMul", "Gemm"),
)


def _int_row(bits):
    top = 2 ** (bits - 1)
    return NumberFormat(
        name=f"int{bits}",
        kind="int",
        bits=bits,
        qmax=top - 1,
        qmin=-top,
        # tf2onnx writes Q/DQ for 8 bits only; fewer are for simulation.
        onnx_type="INT8" if bits == 8 else None,
        tensorrt=bits == 8,
        qdq=_int_qdq,
        **(_INT4_BLOCKS if bits == 4 else {}),
    )


def _broadcast(amax, x, axis):
    if axis is None:
        return amax
    shape = [1] * x.shape.rank
    shape[axis] = -1
    return tf.reshape(amax, shape)


def _scale(fmt, amax):
    """`amax / qmax` rounded once to float32, the scale `NumberFormat.scale`
    gives the export, also in a `tf.function` and under XLA (Grappler and
    XLA turn a division by a constant into a product by its inexact
    reciprocal: `blocks.exact_divide` says why float64 avoids it)."""
    return exact_divide(amax, fmt.qmax)


def _float_qdq(fmt, x, amax, axis, narrow_range):
    """`cast(clip(x / scale, -qmax, qmax), storage) * scale`, `scale =
    amax / qmax`: ONNX's QuantizeLinear (saturating, round to nearest even)
    and DequantizeLinear to a float type, bit for bit, eagerly, in a
    `tf.function` and under XLA (with a range that is not a graph constant,
    as a quantizer's variable: Grappler and XLA would turn `x / scale` by a
    constant scale into a product too)."""
    del narrow_range  # a float grid is symmetric
    scale = _broadcast(_scale(fmt, amax), x, axis)
    q = tf.clip_by_value(x / scale, -fmt.qmax, fmt.qmax)
    codes = tf.cast(q, tf.dtypes.as_dtype(fmt.storage))
    return tf.cast(codes, tf.float32) * scale


def _unsigned_carrier(fmt, x, amax, axis, narrow_range):
    """An unsigned 8-bit Q/DQ of range `[0, amax * 255 / qmax]`: tf2onnx
    writes it with a UINT8 zero point (which no keras_mp quantizer uses
    otherwise) and the scale `amax / qmax`; the export retypes it."""
    del narrow_range
    top = amax * (255.0 / fmt.qmax)
    return tf.raw_ops.QuantizeAndDequantizeV3(
        input=x,
        input_min=tf.zeros_like(top),
        input_max=top,
        num_bits=8,
        signed_input=False,
        range_given=True,
        narrow_range=False,
        axis=-1 if axis is None else axis,
    )


# FP8 E4M3 as TensorRT and ONNX define it (FLOAT8E4M3FN: no infinities,
# largest finite 448): Q/DQ at opset >= 19, where the zero point's type
# selects FP8 in TensorRT's ONNX parser (`docs/quantization.md`). Named as
# Keras names its FP8 mode (`names.py`).
# Its convolutions (ModelOpt's ONNX PTQ, `graph_utils.py`
# `find_nodes_from_convs_to_exclude`, the rules it encodes for TensorRT):
# none with 16 channels or fewer in or out (slower than FP16, and a
# 3-channel first convolution finds no FP8 tactic) or a filter of more
# than 32 taps; their weights per tensor (TensorRT 10.6+ takes per-channel
# FP8 weights for GEMMs). The softmax output of an attention takes the
# fixed scale 1/448 of ModelOpt's FP8 transformer recipe (range 1.0).
_FP8_E4M3 = NumberFormat(
    name="float8",
    kind="float",
    bits=8,
    qmax=448.0,
    qmin=-448.0,
    onnx_type="FLOAT8E4M3FN",
    qdq=_float_qdq,
    storage=ml_dtypes.float8_e4m3fn,
    min_opset=19,
    carrier=_unsigned_carrier,
    tensorrt=True,
    conv_min_channels=16,
    conv_max_taps=32,
    conv_weights_per_tensor=True,
    fixed_softmax_amax=1.0,
    title="FP8",
)


def _block_only(fmt, x, amax, axis, narrow_range):
    raise ValueError(
        f"Format {fmt.name!r} is block-scaled only: quantize weights with "
        f"it in blocks (TensorQuantizer(format={fmt.name!r}, block_size="
        f"{fmt.block_sizes[0]}), QuantizeConfig(precision={fmt.name!r}))."
    )


def _block_row(name, bits, qmax, storage):
    """NVFP4 / MXFP8 as TensorRT 11 builds them (`blocks.py` has the
    grids and ModelOpt's scales): MatMul/Gemm weights in blocks of 16
    (FP8 E4M3 scales times a float32 global scale, FLOAT4E2M1 codes,
    opset 23) or 32 (E8M0 scales, FLOAT8E4M3FN codes, opset 24).
    Weights and activations (W4A4, W8A8): a Dense/EinsumDense input is
    quantized per block along K at run time, exported as TensorRT's
    DynamicQuantize (`keras_mp.onnx.dynamic_blocks`);
    `QuantizeConfig(weights_only=True)` keeps the input float."""
    return NumberFormat(
        name=name,
        kind="block",
        bits=bits,
        qmax=qmax,
        qmin=-qmax,
        onnx_type=None,
        qdq=_block_only,
        storage=storage,
        block=name,
        block_sizes=(block_format(name).block_sizes[0],),
        tensorrt_block_sizes=(block_format(name).block_sizes[0],),
        tensorrt_ops=("MatMul", "Gemm"),
    )


# Every format a quantizer accepts, by name. The int rows are the widths
# `QuantizeConfig(precision=...)` accepts; TensorRT runs int8 and float8, and
# the block-scaled int4 (weights), nvfp4 and mxfp8.
FORMATS = types.MappingProxyType(
    {
        row.name: row
        for row in [
            *map(_int_row, range(2, 9)),
            _FP8_E4M3,
            _block_row("nvfp4", 4, 6.0, ml_dtypes.float4_e2m1fn),
            _block_row("mxfp8", 8, 448.0, ml_dtypes.float8_e4m3fn),
        ]
    }
)


# The Q/DQ element types TensorRT builds (INT8, FLOAT8E4M3FN), as
# `onnx.TensorProto` names: the `onnx_type` of the rows it runs.
TENSORRT_QDQ_TYPES = frozenset(
    row.onnx_type for row in FORMATS.values() if row.tensorrt
)


def format_of_onnx_type(onnx_type):
    """The row exported with zero points of ONNX element type `onnx_type`
    (an `onnx.TensorProto` value or name), or None."""
    if isinstance(onnx_type, int):
        onnx = __import__("onnx")
        onnx_type = onnx.TensorProto.DataType.Name(onnx_type)
    for row in FORMATS.values():
        if row.onnx_type == onnx_type:
            return row
    return None


def number_format(name_or_bits, where="format", warn=True):
    """The `NumberFormat` row of `FORMATS` named `name_or_bits`.

    Args:
        name_or_bits: str, int or `NumberFormat`. A row's name (`"int8"`;
            an old spelling such as `"fp8"` warns, `names.canonical_name`),
            the bits of an int row (`8`), or a row itself (returned as is).
        where: str. The argument named in messages. Defaults to
            `"format"`.
        warn: bool. Warn on an old spelling (False: a saved file's name).
            Defaults to True.

    Returns:
        `NumberFormat`.

    Raises:
        ValueError: no row has that name or width.

    Example:

    >>> row = number_format(8)  # FORMATS["int8"]
    >>> row.qmin, row.qmax, row.narrow_qmin
    (-128, 127, -127)
    """
    if isinstance(name_or_bits, NumberFormat):
        return name_or_bits
    key = name_or_bits
    if isinstance(key, int) and not isinstance(key, bool):
        key = f"int{key}"
    row = None
    if isinstance(key, str) and key.strip().lower() in FORMATS:
        row = FORMATS[key.strip().lower()]
    elif isinstance(key, str):
        row = FORMATS.get(canonical_name(key, where, warn=warn))
    if row is None:
        raise ValueError(
            f"Unknown number format. Expected one of {list(FORMATS)} (a "
            "name, or an int row's bits, e.g. 8). Received: "
            f"{name_or_bits!r}"
        )
    return row

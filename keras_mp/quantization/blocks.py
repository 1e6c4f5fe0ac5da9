"""Block-scaled formats: INT4 weight-only, NVFP4 and MXFP8, in TensorFlow.

A weight of shape `(..., K, ...)` is cut along its blocked axis (the GEMM's
reduction axis K; axis 0 of a Keras `Dense` kernel `(K, N)`) into blocks of
`block_size` values, one scale per block and per output channel, exactly as
ONNX `DequantizeLinear` with `block_size` reads them (scale shape `(...,
K / block_size, ...)`):

- `"int4"`: signed codes in [-8, 7], float32 block scales `amax / 7`
  (ModelOpt's INT4 AWQ / blockwise configs: `narrow_range=False`, bound 7);
  block size 128 (default), 64 or 32. ONNX: INT4, opset 21.
- `"nvfp4"`: E2M1 codes (0, 0.5, 1, 1.5, 2, 3, 4, 6), FP8 E4M3 scales per
  16 values and a float32 per-tensor scale `amax / (6 * 448)`, as
  ModelOpt's `NVFP4QTensor` computes them. ONNX: a DequantizeLinear of the
  FP8 scales by the float32 scale, then a blocked DequantizeLinear of the
  FLOAT4E2M1 codes (opset 23).
- `"mxfp8"`: E4M3 codes, E8M0 (power of two) scales per 32 values,
  `2 ** ceil(log2(amax / 448))` as ModelOpt's MXFP8 ONNX exporter
  computes them. ONNX: FLOAT8E4M3FN codes, FLOAT8E8M0 scales (opset 24).

The blocked axis must be a multiple of `block_size`. ONNX allows a shorter
last block, but TensorRT's ONNX parser infers the block size from the
weight and scale shapes (`input dim / scale dim`), so a ragged block is
misread or rejected: such a weight is refused here, not padded.

`block_quantize_dequantize` is the fake quantization (eager, `tf.function`,
XLA; straight-through gradient); `block_encode` gives the codes and scales
an exporter writes as initializers. Both run the same TensorFlow code.
Guide: `docs/quantization.md` ("Block-scaled formats").
"""

import dataclasses
import types
from collections.abc import Callable

import ml_dtypes
import numpy as np
import tensorflow as tf

_FP8_MAX = 448.0
_E2M1_MAX = 6.0


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """A block-scaled number format: its grid, block sizes and ONNX types.

    Attributes:
        name: str. `"int4"`, `"nvfp4"` or `"mxfp8"`.
        block_sizes: tuple of int. The block sizes accepted, default first.
        qmax: float. The largest code magnitude; a block's max maps to it.
        qmin: float. The most negative code (-8 for INT4, `-qmax` for the
            float grids).
        onnx_type: str. The `onnx.TensorProto` type of the codes.
        scale_onnx_type: str. The `onnx.TensorProto` type of the block
            scales (`"FLOAT"`, `"FLOAT8E4M3FN"`, `"FLOAT8E8M0"`).
        min_opset: int. The lowest ONNX opset with Q/DQ of these types.
        storage: numpy dtype of the codes (an `ml_dtypes` type).
        scale_storage: numpy dtype of the block scales.
        global_scale: bool. True when a float32 per-tensor scale multiplies
            the block scales (NVFP4).
        quantize: callable `(blocks, amax, scale, axis) -> _Quantized`. The
            format's math on the weight split into blocks along `axis + 1`
            (`amax` their max, `scale` given INT4 scales or None).
    """

    name: str
    block_sizes: tuple
    qmax: float
    qmin: float
    onnx_type: str
    scale_onnx_type: str
    min_opset: int
    storage: type
    scale_storage: type
    quantize: Callable = dataclasses.field(repr=False)
    global_scale: bool = False


@dataclasses.dataclass(frozen=True)
class BlockCodes:
    """What an exporter writes for one block-quantized weight.

    `DequantizeLinear(codes, scale * global_scale, axis=axis,
    block_size=block_size)` gives the quantized weight back, bit for bit
    equal to `block_quantize_dequantize`.

    Attributes:
        format: str. The `FORMATS` row's name.
        codes: numpy array of `storage` type, shaped like the weight.
        scale: numpy array of `scale_storage` type, the weight's shape with
            `K / block_size` on the blocked axis.
        global_scale: float32 numpy scalar (NVFP4) or None.
        axis: int. The blocked axis (non-negative).
        block_size: int.
    """

    format: str
    codes: np.ndarray
    scale: np.ndarray
    global_scale: object
    axis: int
    block_size: int


def block_format(name):
    """The `BlockFormat` row of `FORMATS` named `name` (or a row itself).

    Raises:
        ValueError: no row has that name.
    """
    if isinstance(name, BlockFormat):
        return name
    row = FORMATS.get(name) if isinstance(name, str) else None
    if row is None:
        raise ValueError(
            f"Unknown block format. Expected one of {list(FORMATS)}. "
            f"Received: format={name!r}"
        )
    return row


def block_quantize_dequantize(
    x, format="int4", block_size=None, axis=0, scale=None
):
    """Fake-quantizes `x` in a block-scaled format, as ONNX Q/DQ does.

    The scales come from `x` itself (max per block, ModelOpt's "dynamic"
    blocks), or for INT4 from `scale` (e.g. found by
    `kernel_calibration.gptq`). The gradient is the straight-through
    estimator with respect to `x` (scales are constants): everything
    passes when the scales come from `x`; with a given INT4 `scale`,
    values outside `[-8 * scale, 7 * scale]` get zero.

    Args:
        x: float tensor with a static size on `axis`. float16 / bfloat16
            are quantized in float32 and cast back.
        format: str or `BlockFormat`. `"int4"`, `"nvfp4"` or `"mxfp8"`.
            Defaults to `"int4"`.
        block_size: int or None. Values per block along `axis`; None for
            the format's default (128, 16, 32). Only INT4 offers a choice
            (32, 64, 128).
        axis: int. The blocked axis: the GEMM's reduction axis K (0 for a
            Keras `Dense` kernel). Defaults to 0.
        scale: float32 array or None. INT4 only: the block scales, shaped
            like `x` with `K / block_size` on `axis`.

    Returns:
        A tensor like `x`.

    Raises:
        ValueError: an unknown format, a block size the format does not
            take, a blocked axis that is not a multiple of it, or a
            `scale` for a format whose scales follow from the data.

    Example:

    >>> w = tf.random.normal((256, 8))
    >>> wq = block_quantize_dequantize(w, "int4", block_size=128)
    >>> wq.shape
    TensorShape([256, 8])
    """
    fmt, block_size, axis = _check(x, format, block_size, axis, scale)
    dtype = x.dtype
    x32 = tf.cast(x, tf.float32)
    if scale is not None:
        scale = tf.cast(scale, tf.float32)

    @tf.custom_gradient
    def forward(x):
        out = _quantize(x, fmt, block_size, axis, scale)

        def grad(dy):
            if scale is None:
                return dy
            low, high = fmt.qmin * out.scale, fmt.qmax * out.scale
            xb = _blocked(x, block_size, axis)
            inside = tf.logical_and(xb >= low, xb <= high)
            return dy * tf.reshape(tf.cast(inside, dy.dtype), tf.shape(x))

        return tf.reshape(out.values * out.scale, tf.shape(x)), grad

    return tf.cast(forward(x32), dtype)


def block_encode(w, format="int4", block_size=None, axis=0, scale=None):
    """The codes and scales of `w` in a block-scaled format, for export.

    Same arguments as `block_quantize_dequantize`; runs the same code
    eagerly.

    Returns:
        `BlockCodes`. `codes` are `ml_dtypes.int4`, `float4_e2m1fn` or
        `float8_e4m3fn`; `onnx.numpy_helper.from_array` writes them (and
        the FP8 / E8M0 scales) as INT4 / FLOAT4E2M1 / FLOAT8E4M3FN /
        FLOAT8E8M0 initializers, packing 4-bit codes two to a byte like
        `pack_nibbles`.

    Example:

    >>> codes = block_encode(np.ones((32, 4), np.float32), "mxfp8")
    >>> codes.codes.dtype.name, codes.scale.shape
    ('float8_e4m3fn', (1, 4))
    """
    fmt, block_size, axis = _check(w, format, block_size, axis, scale)
    w = tf.cast(w, tf.float32)
    if scale is not None:
        scale = tf.cast(scale, tf.float32)
    out = _quantize(w, fmt, block_size, axis, scale)
    codes = tf.reshape(out.values, tf.shape(w)).numpy().astype(fmt.storage)
    stored = np.squeeze(out.stored.numpy(), axis=axis + 1)
    stored = stored.astype(fmt.scale_storage)  # exact: already on its grid
    global_scale = None
    if fmt.global_scale:
        global_scale = np.float32(out.global_scale.numpy())
    return BlockCodes(fmt.name, codes, stored, global_scale, axis, block_size)


def block_activation_quantize_dequantize(x, format, amax=None):
    """Fake-quantizes an activation in NVFP4 or MXFP8, as TensorRT's
    DynamicQuantize and the DequantizeLinear after it compute it.

    Blocks of the format's size run along the last axis (the K of the GEMM
    `x` feeds); each block's scale follows from its own values at run time
    (ModelOpt's "dynamic" input quantizers, exported as
    `trt::TRT_FP4DynamicQuantize` / `trt::TRT_MXFP8DynamicQuantize`,
    `modelopt/torch/quantization/export_onnx.py`):

    - NVFP4: a per-tensor global scale `amax / (6 * 448)` from the
      calibrated range `amax` (1 when 0); per block, `block_amax / 6`
      divided by it, saturated at 448 and rounded to FP8 E4M3 (1 for an
      all-zero block; ModelOpt's `_nvfp4_act_qdq_eager`), times the
      global scale; values rounded to E2M1 on it (a block whose FP8 scale
      underflows to 0 gives zeros, as the DequantizeLinear of a 0 scale).
    - MXFP8: the E8M0 scale `2 ** ceil(log2(block_amax / 448))` of
      ModelOpt's MXFP8 weights (`_mxfp8`); `amax` is not used.

    The gradient is straight-through (everything passes: the scales follow
    from the data). float16 / bfloat16 are quantized in float32 and cast
    back.

    Args:
        x: float tensor whose last axis is static and a multiple of the
            format's block size (16, 32).
        format: str or `BlockFormat`. `"nvfp4"` or `"mxfp8"`.
        amax: float32 scalar. NVFP4: the calibrated per-tensor range.

    Returns:
        A tensor like `x`.

    Raises:
        ValueError: a format without activations (`"int4"`) or a last
            axis the block size does not divide.

    Example:

    >>> x = tf.random.normal((2, 64))
    >>> block_activation_quantize_dequantize(x, "mxfp8").shape
    TensorShape([2, 64])
    """
    fmt = block_format(format)
    if fmt.scale_onnx_type == "FLOAT":
        raise ValueError(
            f"Block format {fmt.name!r} is weight-only: TensorRT quantizes "
            "activations dynamically in 'nvfp4' and 'mxfp8' only. "
            f"Received: format={fmt.name!r}"
        )
    fmt, block_size, axis = _check(x, fmt, None, -1, None)
    dtype = x.dtype
    x32 = tf.cast(x, tf.float32)
    amax = tf.cast(0.0 if amax is None else amax, tf.float32)

    @tf.custom_gradient
    def forward(x):
        xb = _blocked(x, block_size, axis)
        block_amax = tf.reduce_max(tf.abs(xb), axis=axis + 1, keepdims=True)
        if fmt.global_scale:
            out = _nvfp4_activation(xb, block_amax, amax)
        else:
            out = _mxfp8(xb, block_amax, None, axis)
        return tf.reshape(out.values * out.scale, tf.shape(x)), lambda dy: dy

    return tf.cast(forward(x32), dtype)


def activation_global_scale(amax):
    """NVFP4's per-tensor activation scale `amax / (6 * 448)` as float32
    (1 when `amax` is 0), the initializer `TRT_FP4DynamicQuantize` reads."""
    scale = exact_divide(tf.cast(amax, tf.float32), _E2M1_MAX * _FP8_MAX)
    return tf.where(scale > 0, scale, 1.0)


def _nvfp4_activation(xb, block_amax, amax):
    global_scale = activation_global_scale(amax)
    per_block = exact_divide(block_amax, _E2M1_MAX)
    ratio = tf.cast(
        tf.cast(per_block, tf.float64) / tf.cast(global_scale, tf.float64),
        tf.float32,
    )
    fp8 = tf.dtypes.as_dtype(ml_dtypes.float8_e4m3fn)
    block = tf.cast(tf.cast(tf.minimum(ratio, _FP8_MAX), fp8), tf.float32)
    block = tf.where(per_block > 0, block, 1.0)
    # DequantizeLinear(FP8 block scale, global scale): one float32 product.
    scale = block * global_scale
    v = xb / tf.where(scale > 0, scale, 1.0)
    codes = tf.where(scale > 0, _e2m1(v), 0.0)
    return _Quantized(codes, scale, block, global_scale)


def pack_nibbles(codes):
    """4-bit codes packed two to a byte, as ONNX stores INT4 / FLOAT4E2M1.

    The tensor is flattened in row-major order; element `2i` goes to the
    low nibble of byte `i`, element `2i + 1` to its high nibble; an odd
    count ends with a zero nibble.

    Args:
        codes: numpy array of `ml_dtypes.int4` or `ml_dtypes.float4_e2m1fn`.

    Returns:
        uint8 numpy array of `ceil(codes.size / 2)` bytes.
    """
    codes = np.asarray(codes)
    if codes.dtype not in (ml_dtypes.int4, ml_dtypes.float4_e2m1fn):
        raise ValueError(
            "pack_nibbles takes ml_dtypes.int4 or float4_e2m1fn codes "
            f"(`block_encode(...).codes`). Received: dtype={codes.dtype}"
        )
    nibbles = codes.reshape(-1).view(np.uint8) & 0x0F
    if nibbles.size % 2:
        nibbles = np.append(nibbles, np.uint8(0))
    return (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8)


@dataclasses.dataclass
class _Quantized:
    values: tf.Tensor  # grid values (codes as float32), blocked layout
    scale: tf.Tensor  # float32 scale of each block, keepdims
    stored: tf.Tensor  # the scale initializer's values, keepdims
    global_scale: tf.Tensor = None


def _check(x, format, block_size, axis, scale):
    fmt = block_format(format)
    if block_size is None:
        block_size = fmt.block_sizes[0]
    if block_size not in fmt.block_sizes:
        raise ValueError(
            f"Block format {fmt.name!r} takes block_size in "
            f"{list(fmt.block_sizes)}. Received: block_size={block_size!r}"
        )
    shape = tuple(x.shape)
    if not -len(shape) <= axis < len(shape):
        raise ValueError(
            f"`axis` must name an axis of a rank-{len(shape)} tensor. "
            f"Received: axis={axis}"
        )
    axis %= len(shape)
    k = shape[axis]
    if k is None or k % block_size:
        raise ValueError(
            f"The blocked axis must be a multiple of block_size: TensorRT "
            "infers the block size from the weight and scale shapes, so a "
            "shorter last block (which ONNX allows) is misread. Keep this "
            "weight in a per-channel format or pick a block size dividing "
            f"it. Received: shape={shape}, axis={axis}, "
            f"block_size={block_size}"
        )
    if scale is not None:
        if fmt.scale_onnx_type != "FLOAT":
            raise ValueError(
                f"{fmt.name} block scales follow from the data (its "
                f"{fmt.scale_onnx_type} scale type leaves no choice); only "
                "formats with float32 scales ('int4') take a `scale`. "
                f"Received: scale with format={fmt.name!r}"
            )
        want = shape[:axis] + (k // block_size,) + shape[axis + 1 :]
        got = tuple(getattr(scale, "shape", np.shape(scale)))
        if got != want:
            raise ValueError(
                f"`scale` must have shape {want} (the weight's, with K / "
                "block_size on the blocked axis). Received: "
                f"scale.shape={got}"
            )
    return fmt, block_size, axis


def _blocked(x, block_size, axis):
    """`x` with its blocked axis split into (blocks, block_size)."""
    static = x.shape.as_list()
    k = static[axis]
    if None in static:  # one -1 at most: the unknown ones read at run time
        dynamic = tf.unstack(tf.shape(x))
        shape = [dynamic[i] if d is None else d for i, d in enumerate(static)]
    else:
        shape = list(static)
    shape[axis : axis + 1] = [k // block_size, block_size]
    return tf.reshape(x, tf.stack(shape) if None in static else shape)


def _quantize(x, fmt, block_size, axis, scale):
    xb = _blocked(x, block_size, axis)
    amax = tf.reduce_max(tf.abs(xb), axis=axis + 1, keepdims=True)
    return fmt.quantize(xb, amax, scale, axis)


def _int4(xb, amax, scale, axis):
    if scale is None:
        # ModelOpt's scale `amax / 7`; an all-zero block gets 1 (its codes
        # are 0 either way, and TensorRT needs a positive scale).
        scale = tf.where(amax > 0, exact_divide(amax, 7.0), 1.0)
    else:
        scale = tf.expand_dims(scale, axis + 1)
    # Round half to even and saturate, as ONNX QuantizeLinear; the int cast
    # turns a -0.0 code into 0, as INT4 has no negative zero.
    codes = tf.clip_by_value(tf.round(xb / scale), -8.0, 7.0)
    codes = tf.cast(tf.cast(codes, tf.int32), tf.float32)
    return _Quantized(codes, scale, scale)


def _nvfp4(xb, amax, scale, axis):
    del scale, axis  # the scales follow from the data
    # NVFP4QTensor.get_weights_scaling_factor_2 / get_weights_scaling_factor
    # (modelopt/torch/quantization/qtensor/nvfp4_tensor.py).
    tensor_amax = tf.reduce_max(amax)
    global_scale = exact_divide(tensor_amax, _E2M1_MAX * _FP8_MAX)
    global_scale = tf.where(global_scale > 0, global_scale, 1.0)
    block = amax / (_E2M1_MAX * global_scale)
    block = tf.where(block > 0, block, 1.0)
    fp8 = tf.dtypes.as_dtype(ml_dtypes.float8_e4m3fn)
    block = tf.cast(tf.cast(tf.minimum(block, _FP8_MAX), fp8), tf.float32)
    # DequantizeLinear(FP8 block scale, global scale): one float32 product.
    scale = block * global_scale
    v = xb / tf.where(scale > 0, scale, 1.0)
    codes = tf.where(scale > 0, _e2m1(v), 0.0)
    return _Quantized(codes, scale, block, global_scale)


def _e2m1(v):
    """`v` rounded to E2M1 (half to even) and saturated at +-6, keeping the
    sign of zero like a float cast."""
    a = tf.minimum(tf.abs(v), _E2M1_MAX)
    # E2M1's spacing: 0.5 below 2 (subnormals and the first binade), 1 up
    # to 4, 2 up to 6; rounding a/step to even is the format's rounding.
    step = tf.where(a < 2.0, 0.5, tf.where(a < 4.0, 1.0, 2.0))
    magnitude = tf.round(a / step) * step
    negative = tf.bitcast(v, tf.int32) < 0
    return tf.where(negative, -magnitude, magnitude)


def _mxfp8(xb, amax, scale, axis):
    del scale, axis  # the scales follow from the data
    # compute_e8m0 (modelopt/onnx/quantization/quant_utils.py): exponent
    # ceil(log2(amax / 448)), at least -127; taken from the float32 bits
    # so no log2 rounding moves a ratio just above a power of two down.
    ratio = exact_divide(amax, _FP8_MAX)
    bits = tf.bitcast(ratio, tf.int32)
    field = tf.bitwise.right_shift(bits, 23)
    mantissa = tf.bitwise.bitwise_and(bits, 0x7FFFFF)
    normal = field - 127 + tf.cast(mantissa > 0, tf.int32)
    subnormal = tf.where(mantissa > 0x400000, -126, -127)
    exponent = tf.clip_by_value(
        tf.where(field > 0, normal, subnormal), -127, 127
    )
    # Multiply by 2**-exponent (a normal float32) rather than divide by
    # the possibly subnormal 2**exponent, which CPU kernels may flush.
    inverse = _exp2(-exponent)
    fp8 = tf.dtypes.as_dtype(ml_dtypes.float8_e4m3fn)
    v = tf.clip_by_value(xb * inverse, -_FP8_MAX, _FP8_MAX)
    codes = tf.cast(tf.cast(v, fp8), tf.float32)
    codes = tf.where(amax > 0, codes, 0.0)
    scale = _exp2(exponent)
    return _Quantized(codes, scale, scale)


def exact_divide(x, constant):
    """float32 `x / constant`, correctly rounded also inside `tf.function`
    and XLA, which turn a division by a constant into a multiplication by
    its inexact reciprocal (1 ulp off for half of all values): float64
    holds float32 quotients exactly enough to round them correctly (a
    float32 quotient lies at least 2**-49, relative, from a float32 tie;
    the twice-rounded float64 one within 2**-52 of the exact one). Every
    scale of keras_mp's quantizers is computed here (`formats._scale`)."""
    return tf.cast(tf.cast(x, tf.float64) / constant, tf.float32)


def _exp2(exponent):
    """2.0 ** exponent as float32, exact for int32 exponents in [-127, 127]
    (2**-127 is the one subnormal)."""
    normal = tf.bitwise.left_shift(tf.maximum(exponent + 127, 1), 23)
    bits = tf.where(exponent > -127, normal, 1 << 22)
    return tf.bitcast(bits, tf.float32)


_ROWS = (
    BlockFormat(
        name="int4",
        block_sizes=(128, 64, 32),
        qmax=7.0,
        qmin=-8.0,
        onnx_type="INT4",
        scale_onnx_type="FLOAT",
        min_opset=21,
        storage=ml_dtypes.int4,
        scale_storage=np.float32,
        quantize=_int4,
    ),
    BlockFormat(
        name="nvfp4",
        block_sizes=(16,),
        qmax=_E2M1_MAX,
        qmin=-_E2M1_MAX,
        onnx_type="FLOAT4E2M1",
        scale_onnx_type="FLOAT8E4M3FN",
        min_opset=23,
        storage=ml_dtypes.float4_e2m1fn,
        scale_storage=ml_dtypes.float8_e4m3fn,
        quantize=_nvfp4,
        global_scale=True,
    ),
    BlockFormat(
        name="mxfp8",
        block_sizes=(32,),
        qmax=_FP8_MAX,
        qmin=-_FP8_MAX,
        onnx_type="FLOAT8E4M3FN",
        scale_onnx_type="FLOAT8E8M0",
        min_opset=24,
        storage=ml_dtypes.float8_e4m3fn,
        scale_storage=ml_dtypes.float8_e8m0fnu,
        quantize=_mxfp8,
    ),
)
FORMATS = types.MappingProxyType({row.name: row for row in _ROWS})

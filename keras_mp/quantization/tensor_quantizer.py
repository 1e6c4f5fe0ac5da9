"""`TensorQuantizer`: the one fake-quantizer, for weights and activations.

Every Q/DQ of a quantized model is a `TensorQuantizer`: its range `amax`
(state), an on/off switch, a calibration hook, and a `NumberFormat` row
(`formats.py`) for the grid. `QuantizeActivation` (`activation.py`) and
`WeightQuantizer` (`twins.py`) are this class with other defaults, kept
under their registered names so saved files load. Guide:
`docs/quantization.md`.
"""

import math
import warnings

import keras
import numpy as np
import tensorflow as tf

from keras_mp import _keras
from keras_mp._compat import require_tensorflow
from keras_mp.quantization.blocks import block_activation_quantize_dequantize
from keras_mp.quantization.fake_quant import (
    block_amax,
    block_fake_quant,
    block_shape,
    channel_amax,
    check_block_size,
    fake_quant,
    fake_quant_learned,
    matrix_view,
)
from keras_mp.quantization.formats import (
    FORMATS,
    NumberFormat,
    dynamic_carrier,
    number_format,
    tracing,
)


@keras.saving.register_keras_serializable(package="keras_mp")
class TensorQuantizer(keras.layers.Layer):
    """Symmetric fake quantization (Q/DQ) of one tensor, weight or input.

    Quantizes then dequantizes its input on the grid of `format` scaled to
    the range `amax`, a float32 variable: a scalar, or one value per output
    channel (the product of `out_axes`). Where the range comes from:

    - `keras_mp.calibrate` sets it (activations), or `update(tensor)` sets
      it to `max|x|` (weights).
    - With `track_range=True` (weights), each training step sets it to the
      input's `max|x|`, so it follows the weights as they train.
    - Otherwise, if still 0 at the first training step, it is set to that
      batch's `max|x|` (over the global batch under a `tf.distribute`
      strategy; a batch holding NaN or Inf is passed over, as the loss
      scale optimizer skips its step), then stays, unless
      `learned_range=True` trains it (PACT-style gradient).

    `enabled = False` passes the input through unchanged; while `collector`
    is set (by `keras_mp.calibrate`), each input is handed to it and passed
    through.

    Args:
        format: str, int or `NumberFormat`. The number format: a row of
            `keras_mp.quantization.FORMATS` by name, or the bits of an int
            row. Defaults to `"int8"`.
        out_axes: tuple of int. The input's output-channel axes for one
            range per channel (several axes are merged, row-major); `()`
            for one range per tensor. Defaults to `()`.
        narrow_range: bool. Saturate at `[-qmax, qmax]` (int8: `[-127,
            127]`, TensorRT's weights) instead of `[qmin, qmax]` (`[-128,
            127]`). Defaults to False.
        learned_range: bool. Train `amax` (per tensor, full range only).
            Defaults to False.
        track_range: bool. Set `amax` to `max|x|` at every training step.
            Defaults to False.
        num_bits: int or None. Deprecated: pass `format` (`num_bits=8` is
            `format="int8"`); a `DeprecationWarning` names it. Files saved
            with `num_bits` load silently. Defaults to None.
        fixed_range: float or None. A range that neither calibration nor
            training changes (an FP8 softmax output: 1.0, scale 1/448).
            Defaults to None.
        block_size: int or None. Block-scaled weights (a format with a
            `block` row, e.g. `"int4"`): one range per `block_size` values
            along the GEMM's reduction axis K and per output channel, as a
            blocked ONNX DequantizeLinear reads them. None: per tensor or
            per channel. Defaults to None.
        block_axes: tuple of int. With `block_size`: the input's K axes
            (several are merged, in order, as the exported MatMul weight
            merges them); every other axis is an output channel. Defaults
            to `(0,)` (a Dense kernel `(K, N)`).
        dynamic_blocks: bool. Block-scaled activations (`"nvfp4"`,
            `"mxfp8"`): each `block_size` values along the input's last
            axis get a scale from their own values at run time, as
            TensorRT's DynamicQuantize computes it
            (`blocks.block_activation_quantize_dequantize`); `amax` is one
            per-tensor range (NVFP4's global scale `amax / (6 * 448)`,
            set by `keras_mp.calibrate`). Defaults to False.
        **kwargs: Base layer arguments (`name`, `dtype`).

    Raises:
        ValueError: an unknown format, `format` and `num_bits` naming
            different formats, a learned range that is per
            channel, narrow or tracked, or a block size the format does
            not take (or with `out_axes`, a learned or a fixed range).

    Example:

    >>> q = keras_mp.quantization.TensorQuantizer(out_axes=(-1,))
    >>> q.build(kernel.shape)
    >>> q.update(kernel)
    >>> fake_quantized = q(kernel)
    """

    def __init__(
        self,
        format=None,
        out_axes=(),
        narrow_range=False,
        learned_range=False,
        track_range=False,
        num_bits=None,
        fixed_range=None,
        block_size=None,
        block_axes=(0,),
        dynamic_blocks=False,
        **kwargs,
    ):
        require_tensorflow(f"keras_mp.{type(self).__name__}")
        # Float32 math under mixed precision: a range or a scale rounded
        # to float16 is not the one the export writes.
        kwargs.setdefault("dtype", "float32")
        super().__init__(**kwargs)
        self.format = _resolve_format(format, num_bits)
        self.out_axes = tuple(int(a) for a in out_axes)
        if learned_range and (self.out_axes or narrow_range or track_range):
            raise ValueError(
                "A learned range is one trained value per tensor, full "
                "range: it needs out_axes=(), narrow_range=False and "
                f"track_range=False. Received: out_axes={self.out_axes}, "
                f"narrow_range={narrow_range}, track_range={track_range}"
            )
        if fixed_range is not None and (
            learned_range or track_range or self.out_axes
        ):
            raise ValueError(
                "A fixed range is one per-tensor value no training changes: "
                "it needs out_axes=(), learned_range=False and "
                f"track_range=False. Received: fixed_range={fixed_range}"
            )
        self.fixed_range = None if fixed_range is None else float(fixed_range)
        self.dynamic_blocks = bool(dynamic_blocks)
        if self.dynamic_blocks and (
            self.format.kind != "block" or self.out_axes or learned_range
        ):
            raise ValueError(
                "dynamic_blocks=True quantizes an activation in 'nvfp4' or "
                "'mxfp8' (per-block scales at run time, one per-tensor "
                "range): it needs one of those formats, out_axes=() and "
                f"learned_range=False. Received: format={self.format.name!r}"
                f", out_axes={self.out_axes}, learned_range={learned_range}"
            )
        self.block_size = check_block_size(
            self.format,
            block_size,
            self.out_axes,
            learned_range,
            fixed_range,
        )
        self.block_axes = tuple(int(a) for a in block_axes)
        self.narrow_range = bool(narrow_range)
        self.learned_range = bool(learned_range)
        self.track_range = bool(track_range)
        self.enabled = True
        self.collector = None  # set by keras_mp.calibrate
        self.supports_masking = True  # a Q/DQ keeps its input's mask

    @property
    def num_bits(self):
        """The format's bits per value."""
        return self.format.bits

    def build(self, input_shape):
        if self.dynamic_blocks:
            shape = ()
        elif self.block_size:
            shape = block_shape(input_shape, self.block_axes, self.block_size)
        else:
            shape = _num_channels(input_shape, self.out_axes)
        self.amax = self.add_weight(
            name="amax",
            shape=shape,
            initializer=keras.initializers.Constant(self.fixed_range or 0.0),
            dtype="float32",
            trainable=self.learned_range,
            aggregation="only_first_replica",
        )

    def load_own_variables(self, store):
        super().load_own_variables(widen_saved_ranges(self, store))

    def update(self, tensor):
        """Sets the range to `tensor`'s `max|x|` (per channel over
        `out_axes`, or per block)."""
        self.amax.assign(self._amax_of(tensor))

    def _amax_of(self, tensor):
        if self.block_size:
            view, _ = matrix_view(tensor, self.block_axes)
            return block_amax(view, self.block_size)
        return tensor_amax(tensor, self.out_axes)

    def call(self, inputs, training=None):
        if self.collector is not None:
            self.collector.collect(keras.ops.convert_to_numpy(inputs))
            return inputs
        if not self.enabled:
            return inputs
        # float32 math, also for a quantizer saved with a float16 policy
        x = keras.ops.cast(inputs, "float32")
        out = self.quantize_with(x, self.observe(x, training), training)
        return keras.ops.cast(out, inputs.dtype)

    def observe(self, inputs, training=None):
        """The range to quantize `inputs` with: `amax`, set first from
        `inputs` in training (the first batch's `max|x|`, or every batch's
        with `track_range`)."""
        amax = _keras.float_value(self.amax)
        if self.fixed_range is not None:
            return amax
        if training and self.track_range:
            amax = self._amax_of(inputs)
            self.amax.assign(amax)
        elif training and self.block_size and not self.dynamic_blocks:
            # blocks: weights, no strategy
            calibrated = tf.reduce_any(tf.convert_to_tensor(amax) > 0)
            amax = tf.where(calibrated, amax, self._amax_of(inputs))
            self.amax.assign(amax)
        elif training and not self.learned_range:
            # First training step without calibration: start from the batch.
            amax = _first_batch_range(amax, inputs, self.out_axes)
            self.amax.assign(amax)
        return amax

    def quantize_with(self, inputs, amax, training=None):
        """`inputs` fake-quantized on this format's grid over `[-amax,
        amax]` (`amax` from `observe`, or one range shared by several
        quantizers, `twins.QuantizedLayer`)."""
        if self.learned_range:
            out = fake_quant_learned(inputs, amax, self.format)
        elif self.dynamic_blocks and tracing():
            # the export's stand-in, found by its scale and replaced by
            # TensorRT's DynamicQuantize (`onnx/dynamic_blocks.py`)
            out = dynamic_carrier(self, inputs)
        elif self.dynamic_blocks:
            out = block_activation_quantize_dequantize(
                inputs, self.format.block_format, amax
            )
        elif self.block_size and tracing():
            # the export's stand-in: the float weight, which the export
            # finds by its values and writes blocked (`onnx/blocked.py`)
            out = inputs
        elif self.block_size:
            view, back = matrix_view(inputs, self.block_axes)
            out = back(
                block_fake_quant(view, amax, self.format, self.block_size)
            )
        else:
            view, axis, back = _channel_view(inputs, self.out_axes)
            out = back(
                fake_quant(view, amax, axis, self.narrow_range, self.format)
            )
        if training and _keras.in_xla_context():
            # Under XLA the fake-quant op turns NaN into a finite code, so a
            # non-finite batch would reach the loss looking finite and the
            # loss-scale optimizer would not skip it (without XLA the op
            # keeps NaN itself). Training only: the exported graph keeps
            # plain Q/DQ; XLA fuses this select into the fake-quant loop.
            out = tf.where(tf.math.is_finite(inputs), out, inputs)
        return out

    def compute_output_shape(self, input_shape):
        return input_shape

    @classmethod
    def from_config(cls, config):
        # Files name the format by its name at save time ("fp8", or
        # `num_bits` before the format table): load them silently.
        config = dict(config)
        bits = config.pop("num_bits", None)
        name = config.get("format")
        if name is None and bits is not None:
            name = bits
        if name is not None and not isinstance(name, NumberFormat):
            config["format"] = number_format(name, warn=False)
        return cls(**config)

    def get_config(self):
        config = super().get_config()
        config.update(
            format=self.format.name,
            out_axes=self.out_axes,
            narrow_range=self.narrow_range,
            learned_range=self.learned_range,
            track_range=self.track_range,
            fixed_range=self.fixed_range,
            block_size=self.block_size,
            block_axes=self.block_axes,
            dynamic_blocks=self.dynamic_blocks,
        )
        return config


def _resolve_format(format, num_bits):
    """The `NumberFormat` of `format` or the deprecated `num_bits` (int8
    when neither)."""
    if num_bits is None:
        return number_format("int8" if format is None else format)
    try:
        by_bits = number_format(num_bits)
    except ValueError:
        widths = sorted(r.bits for r in FORMATS.values() if r.kind == "int")
        raise ValueError(
            f"`num_bits` must be the bits of an int format ({widths}). "
            f"Received: num_bits={num_bits!r}"
        ) from None
    if format is not None and number_format(format) != by_bits:
        raise ValueError(
            "`format` and `num_bits` name different formats: pass one. "
            f"Received: format={format!r}, num_bits={num_bits!r}"
        )
    warnings.warn(
        f"`num_bits` is deprecated and will be removed in the next release: "
        f"the format is chosen by `format` alone; use "
        f"format={by_bits.name!r}.",
        DeprecationWarning,
        stacklevel=4,
    )
    return by_bits


def _first_batch_range(amax, inputs, out_axes):
    """`amax` when calibrated, else `max|x|` of the global batch (per
    channel over `out_axes`).

    The reductions over the batch run only while `amax` is 0 (a `tf.cond`:
    a calibrated model pays nothing for them). Under a strategy the
    all-gather of the per-replica maxima stays outside the cond, as
    collectives must, on the range's shape.
    """
    amax = tf.convert_to_tensor(amax)
    calibrated = tf.reduce_any(amax > 0)
    local = tf.cond(
        calibrated,
        lambda: tf.zeros_like(amax),
        lambda: _batch_max(inputs, out_axes),
    )
    context = tf.distribute.get_replica_context()
    if context is not None and context.num_replicas_in_sync > 1:
        gathered = context.all_gather(local[None], axis=0)
        local = tf.reduce_max(gathered, axis=0)
    local = tf.where(tf.math.is_finite(local), local, 0.0)
    return tf.where(calibrated, amax, local)


def _batch_max(inputs, out_axes):
    """`max|x|` of this replica's batch; +inf if it holds a non-finite value
    (+inf wins the max over replicas, and marks the batch as skipped)."""
    x = tf.abs(tf.cast(inputs, tf.float32))
    finite = tf.reduce_all(tf.math.is_finite(x))
    return tf.where(finite, tensor_amax(x, out_axes), float("inf"))


def _channel_view(kernel, out_axes):
    """`(view, axis, back)`: `kernel` with its output-channel axes merged
    into the one axis `axis` of `view`, channel index row-major over
    `out_axes` in their order, and `back` to restore the shape. Adjacent
    axes in kernel order merge in place (a depthwise `(kh, kw, in, mult)`
    becomes `(kh, kw, in * mult)`); others (an EinsumDense kernel
    `(heads, hidden, head_dim)` whose output is `(..., heads, head_dim)`)
    are moved last first. `axis` is None for per-tensor (`out_axes ==
    ()`)."""
    if not out_axes:
        return kernel, None, lambda q: q
    rank = len(kernel.shape)
    axes = [a % rank for a in out_axes]
    if len(axes) == 1:
        return kernel, axes[0], lambda q: q
    shape = tf.shape(kernel)
    if axes == list(range(axes[0], axes[-1] + 1)):
        merged = tf.concat([shape[: axes[0]], [-1], shape[axes[-1] + 1 :]], 0)
        return (
            tf.reshape(kernel, merged),
            axes[0],
            lambda q: tf.reshape(q, shape),
        )
    perm = [a for a in range(rank) if a not in axes] + axes
    moved = tf.transpose(kernel, perm)
    rest = rank - len(axes)
    view = tf.reshape(moved, tf.concat([tf.shape(moved)[:rest], [-1]], 0))
    inverse = [perm.index(a) for a in range(rank)]
    return (
        view,
        rest,
        lambda q: tf.transpose(tf.reshape(q, tf.shape(moved)), inverse),
    )


def _num_channels(shape, out_axes):
    if not out_axes:
        return ()
    return (math.prod(int(shape[a]) for a in out_axes),)


def tensor_amax(tensor, out_axes):
    """`max|x|` of `tensor` per output channel (over `out_axes`, merged),
    or over the whole tensor when `out_axes` is `()` (float32)."""
    view, axis, _ = _channel_view(tensor, out_axes)
    if axis is None:
        return tf.reduce_max(tf.abs(tf.cast(view, tf.float32)))
    return channel_amax(view, axis)


def widen_saved_ranges(layer, store):
    """`layer`'s own variables from a Keras weights `store`, as a dict, with
    a per-tensor weight range saved for a weight that is now per-channel
    repeated over its channels.

    Files written before EinsumDense kernels with several output axes
    (attention Q/K/V projections) were quantized per channel hold one range
    for them. Repeating it keeps the loaded model computing exactly what it
    computed when saved; the next training step, or `keras_mp.calibrate`,
    sets the per-channel ranges.

    Args:
        layer: the layer loading its own variables.
        store: the weights store Keras passes to `load_own_variables`.

    Returns:
        dict, the store's values by key.
    """
    values = {key: store[key] for key in store.keys()}
    for i, variable in enumerate(_keras.own_variables(layer)):
        value = values.get(f"{i}")
        if value is None or len(variable.shape) != 1:
            continue
        if np.shape(value) in ((), (1,)) and variable.shape[0] != 1:
            values[f"{i}"] = np.full(
                variable.shape, np.reshape(value, ()), np.float32
            )
            warnings.warn(
                f"Layer {layer.name!r}: the file holds one per-tensor weight "
                f"range for {variable.path!r}, saved before keras_mp "
                "quantized such weights per output channel; it is used for "
                f"each of the {variable.shape[0]} channels, "
                "so the model computes what it did when saved. Run "
                "`keras_mp.calibrate` (or train) to set per-channel ranges, "
                "then save again.",
                stacklevel=2,
            )
    return values

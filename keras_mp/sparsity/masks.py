"""2:4 structured sparsity: magnitude masks, the `model.fit` callback, strip.

TensorRT's sparse Tensor Cores run a layer at up to twice the math rate when,
in every group of `n=4` consecutive input channels, at most `m=2` weights are
non-zero (for each output channel and spatial position). The recipe that
keeps accuracy is: train dense, prune to 2:4 by magnitude, retrain with the
masks fixed, then `strip_sparsity` for export.

Where the mask lives. Each pruned kernel gets a `SparsityMask` constraint:
a Keras constraint that owns the mask as a non-trainable variable and
multiplies the kernel by it. Keras optimizers apply `variable.constraint`
right after every update inside `optimizer.apply`, i.e. inside the compiled
train step, so the mask holds on every step, with `steps_per_execution > 1`
and under XLA. The constraint is stored in the layer config
(`kernel_constraint`), so `keras.saving.load_model` recreates the mask
before the weights load, and its variables are saved beside the layer's
(`layers/<name>/kernel_constraint/vars`), so `.keras` files and
`BackupAndRestore` checkpoints carry the masks. The kernel itself stays an
ordinary variable holding the masked values, which a quantize wrapper can
read and fake-quantize like any other kernel.
"""

import math

import keras
import numpy as np
from keras.src.models.functional import Functional
from keras.src.saving.keras_saveable import KerasSaveable

from keras_mp.selection import layer_matcher

SCHEDULES = ("one_shot", "gradual")
_REGISTERED_NAME = "keras_mp>SparsityMask"


def check_m_n(m, n):
    """Raises a ValueError unless `0 < m < n` are integers."""
    if not isinstance(n, (int, np.integer)) or n <= 0:
        raise ValueError(
            f"`n` (group size) must be a positive integer, e.g. 4. "
            f"Received: n={n!r}"
        )
    if not isinstance(m, (int, np.integer)) or not 0 < m < n:
        raise ValueError(
            f"`m` (weights kept per group) must be an integer with "
            f"0 < m < n, e.g. m=2, n=4. Received: m={m!r}, n={n!r}"
        )


def value(variable):
    """A variable's value as NumPy (works for `tf.distribute` variables)."""
    return keras.ops.convert_to_numpy(variable)


def check_axis(shape, axis):
    """Raises a ValueError unless `axis` indexes a kernel of `shape`."""
    if not -len(shape) <= axis < len(shape):
        raise ValueError(
            f"`axis` must index the kernel's {len(shape)} dimensions. "
            f"Received: axis={axis}, kernel shape {tuple(shape)}"
        )


def _groups(kernel, axis, n, pad):
    """|kernel| moved to `(..., groups, n)`; -1 marks padded channels."""
    w = np.abs(np.asarray(kernel, dtype=np.float64))
    check_axis(w.shape, axis)
    w = np.moveaxis(w, axis, -1)
    channels = w.shape[-1]
    extra = -channels % n
    if extra and not pad:
        raise ValueError(
            f"The kernel has {channels} input channels on axis {axis}, not a "
            f"multiple of n={n}. Pass pad=True to treat it as zero-padded."
        )
    w = np.concatenate([w, np.full(w.shape[:-1] + (extra,), -1.0)], -1)
    return w.reshape(w.shape[:-1] + (-1, n)), channels


def magnitude_mask(kernel, axis, m=2, n=4, pad=False):
    """Keeps the `m` largest |w| of every group of `n` input channels.

    Ties go to the lower channel index, so the mask is deterministic.

    Args:
        kernel: array-like. A layer kernel.
        axis: int. The input-channel axis (see `input_channel_axis`).
        m: int. Weights kept per group. Defaults to 2.
        n: int. Group size. Defaults to 4.
        pad: bool. If True, a channel count that is not a multiple of `n` is
            treated as zero-padded: the last, short group keeps at most `m`.
            Defaults to False.

    Returns:
        A float32 NumPy array of 0s and 1s with the kernel's shape.

    Raises:
        ValueError: bad `m`/`n`/`axis`, or channels not a multiple of `n`
            without `pad=True`.

    Example:

    >>> magnitude_mask([[1.0], [-4.0], [3.0], [2.0]], axis=0)[:, 0]
    array([0., 1., 1., 0.], dtype=float32)
    """
    check_m_n(m, n)
    groups, channels = _groups(kernel, axis, n, pad)
    order = np.argsort(-groups, axis=-1, kind="stable")
    keep = np.zeros(groups.shape, bool)
    np.put_along_axis(keep, order[..., :m], True, axis=-1)
    keep &= groups >= 0
    keep = keep.reshape(keep.shape[:-2] + (-1,))[..., :channels]
    return np.moveaxis(keep, -1, axis).astype("float32")


def is_2_4_sparse(kernel, axis, m=2, n=4, pad=False):
    """True when every group of `n` input channels has at most `m` non-zeros.

    This is TensorRT's structured-sparsity rule: checked for each output
    channel and spatial position along the input-channel axis.

    Args:
        kernel: array-like. A layer kernel (NumPy, TF tensor or variable).
        axis: int. Input-channel axis: 0 for a Dense kernel, -2 for ConvND.
        m: int. Non-zeros allowed per group. Defaults to 2.
        n: int. Group size. Defaults to 4.
        pad: bool. Treat a channel count that is not a multiple of `n` as
            zero-padded; if False such a kernel is not sparse. Defaults to
            False.

    Returns:
        bool.

    Raises:
        ValueError: bad `m`/`n`, or `axis` out of range for the kernel.

    Example:

    >>> is_2_4_sparse(np.array([[0.0], [1.0], [2.0], [0.0]]), axis=0)
    True
    """
    check_m_n(m, n)
    kernel = np.asarray(kernel)
    check_axis(kernel.shape, axis)
    if kernel.shape[axis] % n and not pad:
        return False
    groups, _ = _groups(kernel, axis, n, pad=True)
    return bool(np.all(np.sum(groups > 0, axis=-1) <= m))


TRANSPOSED_CONVS = (
    keras.layers.Conv1DTranspose,
    keras.layers.Conv2DTranspose,
    keras.layers.Conv3DTranspose,
)


def _einsum_specs(equation):
    """`(input spec, kernel spec, output spec)` of an EinsumDense equation."""
    inputs, output = equation.replace("...", "").split("->")
    x_spec, kernel_spec = inputs.split(",")
    return x_spec, kernel_spec, output


def _einsum_axis(equation):
    x_spec, kernel_spec, output = _einsum_specs(equation)
    contracted = [c for c in kernel_spec if c in x_spec and c not in output]
    if not contracted:
        return None
    return kernel_spec.index(contracted[-1])


def input_channel_axis(layer):
    """`(kernel_attr, constraint_attr, axis)` of a prunable layer.

    Axes: Dense `(in, out)`: 0. ConvND and the pointwise kernel of
    SeparableConvND `(..., in, out)`: -2. ConvNDTranspose `(..., out, in)`:
    -1, the layer's input channels, which are the reduction (GEMM K)
    dimension of the deconvolution and axis 0 of the ONNX ConvTranspose
    weight `(in, out, ...)`. EinsumDense: the last kernel axis that the
    equation contracts with the input.

    Args:
        layer: a Keras layer.

    Returns:
        A tuple, or a str saying why the layer cannot be pruned.
    """
    layers = keras.layers
    if isinstance(layer, (layers.DepthwiseConv1D, layers.DepthwiseConv2D)):
        return "depthwise conv: one input channel per output, no channel group"
    if isinstance(layer, layers.Dense):
        return "kernel", "kernel_constraint", 0
    if isinstance(layer, (layers.SeparableConv1D, layers.SeparableConv2D)):
        return "pointwise_kernel", "pointwise_constraint", -2
    if isinstance(layer, TRANSPOSED_CONVS):
        return "kernel", "kernel_constraint", -1
    if isinstance(layer, (layers.Conv1D, layers.Conv2D, layers.Conv3D)):
        return "kernel", "kernel_constraint", -2
    if isinstance(layer, layers.EinsumDense):
        axis = _einsum_axis(layer.equation)
        if axis is None:
            return (
                f"EinsumDense equation '{layer.equation}' contracts no kernel "
                "axis with the input"
            )
        return "kernel", "kernel_constraint", axis
    return f"{type(layer).__name__} is not a supported layer type"


# NVIDIA ASP (apex.contrib.sparsity) prunes a weight only when its output
# channels are a multiple of 8 and its input channels a multiple of 16, the
# shapes sparse Tensor Core kernels take; TensorRT runs other layers dense.
ALIGNED_OUTPUT_CHANNELS = 8
ALIGNED_INPUT_CHANNELS = 16


def output_channels(layer, kernel):
    """Output channels (GEMM N) of a prunable kernel: for EinsumDense, the
    kernel axes that reach the output and are not in the input."""
    if isinstance(layer, TRANSPOSED_CONVS):
        return kernel.shape[-2]
    if isinstance(layer, keras.layers.EinsumDense):
        x_spec, kernel_spec, output = _einsum_specs(layer.equation)
        return math.prod(
            size
            for c, size in zip(kernel_spec, kernel.shape)
            if c in output and c not in x_spec
        )
    return kernel.shape[-1]


def pruning_mask(kernel):
    """The `SparsityMask` of `kernel` when it has pruned it, else None."""
    constraint = getattr(kernel, "constraint", None)
    if isinstance(constraint, SparsityMask) and constraint.pruned:
        return constraint
    return None


def check_eligible(layer, m=2, n=4, pad=False, skip_unaligned=False):
    """The prunable spec of a built layer, or the reason it is skipped."""
    spec = input_channel_axis(layer)
    if isinstance(spec, str):
        return spec
    kernel = getattr(layer, spec[0], None)
    if kernel is None:
        return "layer is not built (call the model on data first)"
    channels = kernel.shape[spec[2]]
    outputs = output_channels(layer, kernel)
    # Checked first: padding cannot make a layer aligned (pad is moot here).
    if skip_unaligned and (
        outputs % ALIGNED_OUTPUT_CHANNELS or channels % ALIGNED_INPUT_CHANNELS
    ):
        return (
            f"{channels} input / {outputs} output channels: sparse Tensor "
            f"Cores want multiples of {ALIGNED_INPUT_CHANNELS} / "
            f"{ALIGNED_OUTPUT_CHANNELS} (skip_unaligned=True, NVIDIA ASP's "
            "rule; TensorRT would run this layer dense)"
        )
    if channels % n and not pad:
        return (
            f"{channels} input channels, not a multiple of {n} "
            "(pass pad=True to zero-pad)"
        )
    return spec


@keras.saving.register_keras_serializable(package="keras_mp")
class SparsityMask(keras.constraints.Constraint, KerasSaveable):
    """Kernel constraint that multiplies the kernel by an m:n mask.

    The mask is a non-trainable variable owned by the constraint. It starts
    all ones (dense); `StructuredSparsity` fills it. An existing kernel
    constraint is kept and applied first.

    Args:
        shape: tuple of int. The kernel shape.
        axis: int. The input-channel axis.
        m: int. Weights kept per group. Defaults to 2.
        n: int. Group size. Defaults to 4.
        pad: bool. Zero-pad the channel axis to a multiple of `n`.
            Defaults to False.
        constraint: the kernel's previous constraint, or None.
    """

    def __init__(self, shape, axis, m=2, n=4, pad=False, constraint=None):
        check_m_n(m, n)
        self.shape = tuple(int(d) for d in shape)
        self.axis = int(axis) % len(self.shape)
        self.m = int(m)
        self.n = int(n)
        self.pad = bool(pad)
        self.constraint = keras.constraints.get(constraint)
        self.mask = keras.Variable(
            initializer="ones",
            shape=self.shape,
            dtype="float32",
            trainable=False,
            name="sparsity_mask",
        )
        # Weights kept per group right now (n means dense, not pruned yet).
        self.kept = keras.Variable(
            self.n, dtype="int32", trainable=False, name="sparsity_kept"
        )
        # Fraction of the dense |w| that the pruning steps kept.
        self.kept_magnitude = keras.Variable(
            1.0, dtype="float32", trainable=False, name="kept_magnitude"
        )

    @property
    def pruned(self):
        """Whether the mask has pruned (fewer than `n` kept per group)."""
        return int(value(self.kept)) < self.n

    def __call__(self, w):
        if self.constraint is not None:
            w = self.constraint(w)
        return w * keras.ops.cast(self.mask, w.dtype)

    def prune(self, kernel, kept=None):
        """Recomputes the mask from `kernel` and applies it to the kernel.

        Args:
            kernel: the kernel variable this constraint belongs to.
            kept: int. Weights kept per group. Defaults to `m`.
        """
        kept = self.m if kept is None else kept
        w = value(kernel)
        mask = magnitude_mask(w, self.axis, kept, self.n, self.pad)
        total = np.abs(w).sum()
        ratio = np.abs(w * mask).sum() / total if total else 1.0
        self.mask.assign(mask)
        self.kept.assign(kept)
        self.kept_magnitude.assign(value(self.kept_magnitude) * ratio)
        kernel.assign(w * mask)

    # The weights file walks KerasSaveable attributes of a layer; this makes
    # the saver visit `layer.kernel_constraint` and store the mask with it.
    # `_obj_type` picks the attribute skip-list; "Loss" is the plain one.
    def _obj_type(self):
        return "Loss"

    def _state(self):
        return [self.mask, self.kept, self.kept_magnitude]

    def save_own_variables(self, store):
        for i, v in enumerate(self._state()):
            store[str(i)] = value(v)

    def load_own_variables(self, store):
        # A file written before sparsity was on holds no mask: keep dense.
        for i, v in enumerate(self._state()):
            if str(i) in store:
                v.assign(store[str(i)])

    def get_config(self):
        return {
            "shape": list(self.shape),
            "axis": self.axis,
            "m": self.m,
            "n": self.n,
            "pad": self.pad,
            "constraint": keras.constraints.serialize(self.constraint),
        }


def check_model(model, caller):
    """Raises a TypeError naming `caller` unless `model` is a keras.Model."""
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"`{caller}` expects a Keras 3 `keras.Model`. Received: "
            f"{type(model).__module__}.{type(model).__name__}. A tf_keras "
            "(Keras 2) model must be rebuilt with `import keras` (Keras 3)."
        )


def weighted_layers(model):
    """The layers of `model` that are prunable or hold a kernel, in order.

    Nested models and `keras.layers.Wrapper`s are entered; each layer is
    listed once.
    """
    seen, out = set(), []
    # Keras' own recursive walk; it also enters keras.layers.Wrapper.layer.
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if id(layer) in seen or isinstance(layer, keras.Model):
            continue
        seen.add(id(layer))
        spec = input_channel_axis(layer)
        if not isinstance(spec, str) or hasattr(layer, "kernel"):
            out.append(layer)
    return out


def select_layers(model, layers=None):
    """The weighted layers of `model` matched by the `layers` selection.

    Raises:
        ValueError: the selection matches no layer; lists the names.
    """
    candidates = weighted_layers(model)
    chosen = [layer for layer in candidates if layer_matcher(layers)(layer)]
    if layers is not None and not chosen:
        names = ", ".join(layer.name for layer in candidates) or "(none)"
        raise ValueError(
            f"`layers={layers!r}` matches no weighted layer of model "
            f"'{model.name}'. Its weighted layers are: {names}."
        )
    return chosen


def _strip_config(config):
    if isinstance(config, dict):
        if config.get("registered_name") == _REGISTERED_NAME:
            return config["config"]["constraint"]
        return {k: _strip_config(v) for k, v in config.items()}
    if isinstance(config, list):
        return [_strip_config(v) for v in config]
    return config


def strip_sparsity(model):
    """Returns a plain Keras copy of `model` with the 2:4 zeros baked in.

    The copy has no `SparsityMask` constraints (a previous kernel constraint
    is restored), its kernels hold the masked values, and it computes the
    same outputs. It is not compiled.

    Args:
        model: a Sequential or Functional `keras.Model`.

    Returns:
        A new `keras.Model`.

    Raises:
        TypeError: `model` is not a Keras 3 model, or is subclassed.

    Example:

    >>> deploy = strip_sparsity(model)  # doctest: +SKIP
    >>> deploy.export("model", format="onnx")  # doctest: +SKIP
    """
    check_model(model, "strip_sparsity")
    if not isinstance(model, (keras.Sequential, Functional)):
        raise TypeError(
            f"`strip_sparsity` copies a Sequential or Functional model; "
            f"model {model.name!r} is a subclassed {type(model).__name__}, "
            "whose graph is Python code that cannot be copied. Its kernels "
            "already hold the 2:4 zeros; to export it without the "
            "SparsityMask constraints, rebuild it with the Functional API "
            "(keras.Model(inputs, outputs)) and copy the weights over."
        )
    clone = keras.models.clone_model(
        model,
        clone_function=lambda layer: layer.__class__.from_config(
            _strip_config(layer.get_config())
        ),
        recursive=True,
    )
    values = []
    for v in model.weights:
        w = value(v)
        if isinstance(getattr(v, "constraint", None), SparsityMask):
            w = w * value(v.constraint.mask)
        values.append(w)
    clone.set_weights(values)
    return clone


def sparse_layers(model):
    """`(layer, kernel_variable, SparsityMask)` for every masked kernel."""
    out = []
    for layer in weighted_layers(model):
        spec = input_channel_axis(layer)
        if isinstance(spec, str):
            continue
        kernel = getattr(layer, spec[0], None)
        constraint = getattr(kernel, "constraint", None)
        if isinstance(constraint, SparsityMask):
            out.append((layer, kernel, constraint))
    return out

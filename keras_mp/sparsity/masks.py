"""m:n magnitude masks and the `SparsityMask` kernel constraint that holds
one. Where the mask lives and why: `docs/sparsity.md`."""

import keras
import numpy as np

from keras_mp import _keras

SCHEDULES = ("one_shot", "gradual")


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
    return _keras.to_numpy(variable)


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
        axis: int. The input-channel axis (`in_axis` of the layer's
            `keras_mp.layer_table.prunable_weight`).
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


def pattern_level(kernel, axis, n=4, pad=False):
    """The most non-zeros in any group of `n` input channels of `kernel`,
    and the most channels in any group (`n`, or fewer with `pad=True` when
    the kernel has fewer than `n` channels): `(level, dense)`.

    A kernel with `level < dense` has exact zeros in every group, as a
    pruned kernel has (the optimizer multiplies it by its mask after every
    update); a trained dense kernel has `level == dense`.
    """
    groups, _ = _groups(kernel, axis, n, pad)
    level = int(np.max(np.sum(groups > 0, axis=-1)))
    dense = int(np.max(np.sum(groups >= 0, axis=-1)))
    return level, dense


def pruning_mask(kernel):
    """The `SparsityMask` of `kernel` when it has pruned it, else None."""
    constraint = getattr(kernel, "constraint", None)
    if isinstance(constraint, SparsityMask) and constraint.pruned:
        return constraint
    return None


@keras.saving.register_keras_serializable(package="keras_mp")
class SparsityMask(keras.constraints.Constraint, _keras.SaveableState):
    """Kernel constraint that multiplies the kernel by an m:n mask.

    The mask is a non-trainable variable owned by the constraint, saved
    with the layer's weights. It starts all ones (dense);
    `StructuredSparsity` fills it. An existing kernel constraint is kept
    and applied first.

    Args:
        shape: tuple of int. The kernel shape.
        axis: int. The input-channel axis.
        m: int. Weights kept per group. Defaults to 2.
        n: int. Group size. Defaults to 4.
        pad: bool. Zero-pad the channel axis to a multiple of `n`.
            Defaults to False.
        constraint: the kernel's previous constraint, or None.

    Raises:
        ValueError: bad `m`/`n`.

    Example:

    >>> mask = SparsityMask((8, 4), axis=0)
    >>> mask.pruned
    False
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
        # Fraction of the dense |w| that the pruning steps kept; NaN when
        # unknown (a mask restored from the zeros of a kernel).
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

    def restore(self, kernel, kept):
        """Sets the mask from the zeros of `kernel`, pruned earlier to at
        most `kept` non-zeros per group, without changing the kernel.

        The mask is the one `prune(kernel, kept)` makes: on such a kernel
        it keeps every non-zero and, in a group with fewer than `kept`
        (dead weights), the lowest-index zeros, which is what the earlier
        mask kept there unless a weight it kept is exactly zero now.
        `kept_magnitude` becomes NaN (unknown): the dense kernel it was a
        share of is gone.

        Args:
            kernel: the kernel variable this constraint belongs to.
            kept: int. Weights kept per group.

        Raises:
            ValueError: `kernel` has more than `kept` non-zeros in a group.
        """
        w = value(kernel)
        level, _ = pattern_level(w, self.axis, self.n, self.pad)
        if level > kept:
            raise ValueError(
                f"The kernel has {level} non-zeros in a group of {self.n}, "
                f"more than kept={kept}: it is not a pruned kernel to "
                "restore a mask from. Call `prune(kernel, kept)`."
            )
        self.mask.assign(magnitude_mask(w, self.axis, kept, self.n, self.pad))
        self.kept.assign(kept)
        self.kept_magnitude.assign(float("nan"))

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

"""Per-layer 2:4 sparsity report and its plot (matplotlib, optional)."""

import dataclasses
import warnings

import numpy as np

from keras_mp import _models, layer_table
from keras_mp._compat import optional_import
from keras_mp.io import atomic_path
from keras_mp.sparsity.masks import (
    check_m_n,
    is_2_4_sparse,
    magnitude_mask,
    pruning_mask,
    value,
)
from keras_mp.sparsity.model import (
    check_eligible,
    prunable_kernel,
    select_layers,
)
from keras_mp.sparsity.permutation import search_permutation


@dataclasses.dataclass
class LayerSparsity:
    """One row of a `SparsityReport`.

    Attributes:
        name: str. Layer name; for a layer inside a nested model or custom
            layer, its path from the model's top-level layer
            (`"encoder/block_0/query"`).
        class_name: str. Layer class.
        kernel_shape: tuple or None. Shape of the prunable kernel.
        axis: int or None. Input-channel axis of that kernel.
        eligible: bool. The layer is selected for m:n pruning under the
            report's settings (`pad`, `skip_unaligned`).
        reason: str or None. Why it is not, when it is not.
        masked: bool. A `SparsityMask` has pruned it (also reported for a
            layer that is not eligible under these settings but still
            carries a mask from an earlier pruning).
        pattern_valid: bool or None. The kernel satisfies m:n now.
        fraction_zero: float or None. Share of kernel entries that are 0.
        kept_magnitude: float or None. Share of the dense sum |w| that m:n
            keeps: recorded at pruning time for a masked layer (None when
            unknown: a mask `StructuredSparsity` restored from the zeros of
            a kernel that lost its mask), otherwise what magnitude pruning
            of the current kernel would keep.
        kept_magnitude_permuted: float or None. For an unpruned layer, when
            the report was asked for permutations: the share m:n would keep
            after the input-channel order `search_permutation` finds
            (`permute_for_sparsity` applies it where the model allows).
    """

    name: str
    class_name: str
    kernel_shape: tuple = None
    axis: int = None
    eligible: bool = False
    reason: str = None
    masked: bool = False
    pattern_valid: bool = None
    fraction_zero: float = None
    kept_magnitude: float = None
    kept_magnitude_permuted: float = None


@dataclasses.dataclass
class SparsityReport:
    """What `sparsity_report` found; `print(report)` shows a table.

    Attributes:
        rows: list of `LayerSparsity`, in model order.
        m: int. Weights kept per group.
        n: int. Group size.

    Example:

    >>> report = keras_mp.sparsity_report(model)
    >>> print(report)  # one line per layer
    >>> [r.name for r in report.rows if r.eligible]
    """

    rows: list
    m: int = 2
    n: int = 4

    def to_dict(self):
        """The report as plain Python (JSON-ready): `m`, `n` and `rows`,
        one dict per `LayerSparsity`."""
        return dataclasses.asdict(self)

    def to_dicts(self):
        """Deprecated: `report.to_dict()["rows"]`."""
        warnings.warn(
            "SparsityReport.to_dicts() is deprecated: use "
            '`report.to_dict()["rows"]`. It will be removed in the next '
            "release.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.to_dict()["rows"]

    def plot(self, path, title=None):
        """Writes a PNG of the zeros and kept |w| by layer; see
        `plot_sparsity`.

        Returns:
            `path`.
        """
        return plot_sparsity(self, path, title=title)

    def __str__(self):
        def fmt(value):
            if value is None:
                return "-"
            if isinstance(value, float):
                return f"{value:.3f}"
            return str(value)

        header = ("layer", "type", "eligible", f"{self.m}:{self.n}")
        header += ("zeros", "kept |w|", "permuted", "reason")
        lines = [header]
        for r in self.rows:
            lines.append(
                (r.name, r.class_name, fmt(r.eligible), fmt(r.pattern_valid))
                + (fmt(r.fraction_zero), fmt(r.kept_magnitude))
                + (fmt(r.kept_magnitude_permuted), r.reason or "")
            )
        widths = [max(len(c) for c in column) for column in zip(*lines)]
        text = [
            "  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip()
            for line in lines
        ]
        text.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(text)


def _row(layer, name, m, n, pad, permutation, skip_unaligned):
    row = LayerSparsity(name, type(layer).__name__)
    verdict = check_eligible(layer, m, n, pad, skip_unaligned)
    if not verdict.ok:
        row.reason = verdict.reason
        kernel = prunable_kernel(layer)
        if kernel is not None:
            row.kernel_shape = tuple(kernel.shape)
            row.axis = layer_table.prunable_weight(layer).value.in_axis
            if pruning_mask(kernel) is not None:
                # Pruned earlier under other settings: say so.
                row.masked = True
                row.fraction_zero = float(np.mean(value(kernel) == 0))
        return row
    axis = verdict.value.in_axis
    kernel = getattr(layer, verdict.value.attr)
    w = value(kernel)
    row.kernel_shape, row.axis, row.eligible = w.shape, axis, True
    mask = pruning_mask(kernel)
    row.masked = mask is not None
    row.pattern_valid = is_2_4_sparse(w, axis, m, n, pad)
    row.fraction_zero = float(np.mean(w == 0))
    if row.masked:
        kept = float(value(mask.kept_magnitude))
        # NaN: a mask restored from the zeros of its kernel (unknown).
        row.kept_magnitude = None if np.isnan(kept) else kept
    else:
        total = np.abs(w).sum()
        kept = np.abs(w * magnitude_mask(w, axis, m, n, pad)).sum()
        row.kept_magnitude = float(kept / total) if total else 1.0
        if permutation and w.shape[axis] % n == 0:
            found = search_permutation(w, axis, m, n)
            row.kept_magnitude_permuted = found.kept_magnitude_permuted
    return row


def sparsity_report(
    model,
    m=2,
    n=4,
    layers=None,
    pad=False,
    permutation=False,
    skip_unaligned=False,
):
    """Per-layer m:n sparsity of a model: eligible, valid, zeros, magnitude.

    Args:
        model: a built `keras.Model`.
        m: int. Weights kept per group. Defaults to 2.
        n: int. Group size. Defaults to 4.
        layers: optional selection, as in `StructuredSparsity`. Defaults to
            None: every layer with a kernel.
        pad: bool. Count channel counts that are not a multiple of `n` as
            zero-padded. Defaults to False.
        permutation: bool. Also run `search_permutation` on every eligible,
            unpruned kernel and report the |w| share m:n would keep with the
            channel order found (`kept_magnitude_permuted`). The time
            grows with channels times kernel size. Defaults to False.
        skip_unaligned: bool. Count layers that `StructuredSparsity(
            skip_unaligned=True)` leaves dense as not eligible. Defaults to
            False.

    Returns:
        A `SparsityReport`; `print()` it for a table, `.to_dict()` for
        JSON, `.plot(path)` for a chart.

    Raises:
        TypeError: `model` is not a Keras 3 model.
        ValueError: bad `m`/`n`, or `layers` matches no layer.

    Example:

    >>> print(sparsity_report(model))  # doctest: +SKIP
    """
    _models.check_model(model, "sparsity_report")
    check_m_n(m, n)
    paths = _models.layer_paths(model)  # nested layers named by path
    rows = [
        _row(
            layer,
            paths.get(id(layer), layer.name),
            m,
            n,
            pad,
            permutation,
            skip_unaligned,
        )
        for layer in select_layers(model, layers)
    ]
    return SparsityReport(rows, m, n)


def plot_sparsity(report_or_model, path, title=None):
    """Bar chart of per-layer zero fraction and kept |w|, written to PNG.

    A report made with `permutation=True` adds a bar for the kept |w| with
    the channel permutation.

    Needs matplotlib (`pip install keras-mp[plot]`). The PNG is written to
    a temporary file first and moved into place, so `path` is never left
    half-written.

    Args:
        report_or_model: a `SparsityReport` or a `keras.Model`.
        path: str. Where to write the PNG.
        title: str. Figure title. Defaults to "m:n structured sparsity".

    Returns:
        `path`.

    Raises:
        ImportError: matplotlib is missing; names the extra to install.
        TypeError: neither a report nor a Keras model.

    Example:

    >>> plot_sparsity(model, "sparsity.png")  # doctest: +SKIP
    """
    report = report_or_model
    if not isinstance(report, SparsityReport):
        report = sparsity_report(report_or_model)
    optional_import("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = report.rows
    fig = Figure(figsize=(8, 0.35 * len(rows) + 1.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    y = np.arange(len(rows))
    bars = [
        ("fraction zero", [r.fraction_zero for r in rows]),
        ("kept |w| fraction", [r.kept_magnitude for r in rows]),
    ]
    permuted = [r.kept_magnitude_permuted for r in rows]
    if any(x is not None for x in permuted):
        bars.append(("kept |w|, channels permuted", permuted))
    height = 0.8 / len(bars)
    for i, (label, values) in enumerate(bars):
        offset = (i - (len(bars) - 1) / 2) * height
        values = [0.0 if x is None else x for x in values]
        ax.barh(y + offset, values, height=height, label=label)
    labels = [r.name if r.eligible else f"{r.name} (skipped)" for r in rows]
    ax.set_yticks(y, labels)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_title(title or f"{report.m}:{report.n} structured sparsity")
    ax.legend(loc="lower right")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return path

"""A plot of `compare_onnx`'s per-layer error by depth (matplotlib extra)."""

from keras_mp._compat import optional_import
from keras_mp.io import atomic_path


def plot_compare(report, path, title=None):
    """Relative L2 error (log scale) and Q/DQ steps by layer depth, as PNG.

    Needs matplotlib (`pip install keras-mp[plot]`). The PNG is written to
    a temporary file first and moved into place, so `path` is never left
    half-written.

    Args:
        report: a `CompareReport` from `keras_mp.compare_onnx`.
        path: str. Where to write the PNG.
        title: str. Figure title. Defaults to "Keras vs ONNX Runtime by
            layer".

    Returns:
        `path`.

    Raises:
        ImportError: matplotlib is missing; names the extra to install.

    Example:

    >>> report = keras_mp.compare_onnx(qmodel, "m.onnx", x)  # doctest: +SKIP
    >>> plot_compare(report, "err.png")  # doctest: +SKIP
    """
    optional_import("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = report.rows
    fig = Figure(figsize=(max(6, 0.4 * len(rows) + 2), 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    depth = [r.depth for r in rows]
    ax.semilogy(
        depth, [max(r.rel_l2, 1e-12) for r in rows], "o-", label="rel L2"
    )
    ax.axhline(report.max_rel_l2, color="gray", ls=":", lw=1)
    ax.set_xticks(depth, [r.name for r in rows], rotation=60, ha="right")
    ax.set_ylabel("relative L2 vs Keras")
    quantized = [r for r in rows if r.steps is not None]
    if quantized:
        steps = ax.twinx()
        steps.bar(
            [r.depth for r in quantized],
            [r.steps for r in quantized],
            alpha=0.3,
            color="tab:orange",
            label="Q/DQ steps",
        )
        steps.axhline(report.max_steps, color="tab:orange", ls=":", lw=1)
        steps.set_ylabel("Q/DQ error (quantization steps)")
    first = report.first_divergence
    if first is not None:
        ax.axvline(first.depth, color="tab:red", lw=1, label="first divergence")
    ax.legend(loc="upper left")
    ax.set_title(title or "Keras vs ONNX Runtime by layer")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return path

"""Plot of a MuPPET run: p(e), T(e) and the word length over epochs."""

import math

import numpy as np

from keras_mp._compat import optional_import
from keras_mp.io import atomic_path
from keras_mp.muppet.policy import switching_threshold


def _precision_history(history_or_callback):
    # A PrecisionSwitching callback's `history` has an "epoch" list; a
    # History's has the fit logs.
    logs = getattr(history_or_callback, "history", history_or_callback)
    if not isinstance(logs, dict) or "precision" not in logs:
        raise ValueError(
            "plot_precision() needs a PrecisionSwitching callback, or the "
            "History (or its dict) of a fit that used one; received "
            f"{type(history_or_callback).__name__} without 'precision'."
        )
    n = len(logs["precision"])
    return {
        "epoch": logs.get("epoch", list(range(n))),
        "precision": logs["precision"],
        "p": logs.get("p", [math.nan] * n),
        "T": logs.get("T", [switching_threshold(e) for e in range(n)]),
    }


def plot_precision(history_or_callback, path):
    """Plots p(e), T(e) and the precision over epochs to a PNG file.

    Args:
        history_or_callback: a `PrecisionSwitching` callback, a `History`
            returned by `fit`, or its `.history` dict.
        path: str. Output PNG path, written atomically.

    Returns:
        `path`.

    Raises:
        ValueError: no precision history in `history_or_callback`.
        FileNotFoundError: the folder of `path` does not exist.
        ImportError: matplotlib is missing (`pip install keras-mp[plot]`).

    Example:

    >>> plot_precision(history, "precision.png")  # doctest: +SKIP
    """
    data = _precision_history(history_or_callback)
    optional_import("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    with atomic_path(path) as tmp:
        epochs = np.asarray(data["epoch"])
        fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(7, 5))
        try:
            top.plot(epochs, data["T"], "-", label="T(e) = 1 + 1.5 exp(-0.1 e)")
            top.plot(
                epochs, data["p"], "o", label="p = max diversity / diversity"
            )
            top.set_ylabel("p, T")
            top.legend()
            bits = [32 if b is None else b for b in data["precision"]]
            bottom.step(epochs, bits, where="post")
            bottom.set_ylabel("word length (bits)")
            bottom.set_xlabel("epoch")
            top.set_title("MuPPET precision switching")
            fig.tight_layout()
            fig.savefig(tmp, format="png")
        finally:
            plt.close(fig)
    return path

"""The reports of `layer_sensitivity` and `auto_quantize`: rows, printed
tables, `to_dict()` and a plot."""

import dataclasses
import warnings

import numpy as np

from keras_mp.io import atomic_path


@dataclasses.dataclass
class SensitivityRow:
    """One quantizable layer, or a coupled group of them.

    Attributes:
        name: str. The layer path, or for a group its parent's path and
            the members' names (`encoder/attention/{query,key,value}`).
        layers: tuple of str. The layer paths of the group.
        layer_type: str. The float class name(s).
        scores: dict. Precision -> score (higher: more sensitive).
        formats: dict. Precision -> the format the layer really takes
            (an FP8 convolution TensorRT cannot run in FP8 takes INT8).
        work: `keras_mp.precision.cost.LayerWork` of one scoring batch
            (FLOPs, weights, activations), for the cost model.
        reads_input: bool. It reads a model input, so a quantized choice
            pays a stand-alone Quantize kernel (elsewhere TensorRT fuses
            the Q into the kernel producing the input).
    """

    name: str
    layers: tuple
    layer_type: str
    scores: dict
    formats: dict
    work: object = None
    reads_input: bool = False


_SCORES = {
    "gradient": "gradient score sum((dL/dy * delta_y)^2)",
    "kl": "KL divergence of the output",
    "metric": "metric drop with the layer alone quantized",
}


@dataclasses.dataclass
class SensitivityReport:
    """What `layer_sensitivity` measured.

    Attributes:
        rows: list of `SensitivityRow`, most sensitive first (by the
            largest score over the precisions).
        method: str. `"gradient"` (labels or a loss), `"kl"` (neither)
            or `"metric"` (a metric: its drop when the layer alone is
            quantized).
        precisions: tuple of str.
        calibration: str. The calibration method of the ranges scored.
        samples: int. Samples in the scoring batches.
        passes: dict. Forward and backward passes over a batch:
            `{"calibration": n, "forward": n, "backward": n}`.
        seconds: float. Wall time.
        metric: str. The metric whose drop is scored (method
            `"metric"`), else "".

    Example:

    >>> report = keras_mp.layer_sensitivity(model, x[:256], y[:256])
    >>> print(report)  # most sensitive layers first
    >>> report.rows[0].name
    """

    rows: list
    method: str
    precisions: tuple
    calibration: str
    samples: int
    passes: dict
    seconds: float
    metric: str = ""

    def to_table(self):
        what = _SCORES[self.method]
        if self.metric:
            what = f"drop of {self.metric} with the layer alone quantized"
        lines = [
            f"Layer sensitivity ({what}; {self.samples} samples, "
            f"{self.calibration} ranges, {self.seconds:.1f} s):",
            "  "
            + f"{'layer':<48} {'type':<18}"
            + "".join(f" {p:>11}" for p in self.precisions)
            + f" {'GFLOP':>8}",
        ]
        for row in self.rows:
            cells = []
            for p in self.precisions:
                cell = f"{row.scores[p]:.3g}"
                if row.formats[p] != p:
                    cell += f" ({row.formats[p]})"
                cells.append(f" {cell:>11}")
            flops = row.work.flops / 1e9 if row.work is not None else 0.0
            lines.append(
                f"  {row.name[-48:]:<48} {row.layer_type[:18]:<18}"
                + "".join(cells)
                + f" {flops:>8.3f}"
            )
        return "\n".join(lines)

    def __str__(self):
        return self.to_table()

    def to_dict(self):
        """The report as plain Python (JSON-ready)."""
        out = dataclasses.asdict(self)
        for row, raw in zip(self.rows, out["rows"]):
            raw["layers"] = list(row.layers)
            raw["work"] = (
                None if row.work is None else dataclasses.asdict(row.work)
            )
        return out

    def plot(self, path=None, top=30):
        """A bar chart of the `top` most sensitive rows, one bar per
        precision, log scale (needs matplotlib: `pip install
        keras_mp[plot]`). Saves to `path` when given.

        Returns:
            The matplotlib `Figure`.
        """
        try:
            import matplotlib

            if path is not None:
                matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError(
                "SensitivityReport.plot needs matplotlib: "
                "pip install 'keras_mp[plot]'"
            ) from e
        rows = self.rows[:top][::-1]
        fig, ax = plt.subplots(figsize=(8, 0.3 * len(rows) + 1.5))
        height = 0.8 / len(self.precisions)
        for k, p in enumerate(self.precisions):
            floor = -np.inf if self.method == "metric" else 1e-30
            values = [max(r.scores[p], floor) for r in rows]
            ys = np.arange(len(rows)) + k * height
            ax.barh(ys, values, height=height, label=p)
        ax.set_yticks(np.arange(len(rows)) + 0.4 - height / 2)
        ax.set_yticklabels([r.name[-40:] for r in rows], fontsize=7)
        if self.method != "metric":  # a metric drop can be 0 or negative
            ax.set_xscale("log")
        ax.set_xlabel(f"sensitivity ({_SCORES[self.method]})")
        ax.legend()
        fig.tight_layout()
        if path is not None:
            with atomic_path(path, suffix=".png") as tmp:
                fig.savefig(tmp, dpi=120)
        return fig


@dataclasses.dataclass
class Choice:
    """The precision chosen for one layer (or coupled group).

    Attributes:
        name: str. As `SensitivityRow.name`.
        layers: tuple of str. Its layer paths.
        precision: str. `"float"` (not quantized), `"int8"` or `"float8"`.
        scores: dict. Precision -> sensitivity score (float: 0).
        costs: dict. Precision -> cost (seconds, or weight bits).
        flops: float. FLOPs of one scoring batch.
        reason: str. Why this precision.
    """

    name: str
    layers: tuple
    precision: str
    scores: dict
    costs: dict
    flops: float
    reason: str


@dataclasses.dataclass
class AutoQuantizeReport:
    """What `auto_quantize` chose, why, and what it cost to find out.

    Attributes:
        rows: list of `Choice`, in the model's layer order (`choices`
            before; that name still reads them, with a DeprecationWarning).
        metric_float: float. The metric of the float model.
        metric: float. The metric of the chosen configuration.
        max_drop: float.
        cost: str. `"latency"` or `"bits"`.
        gpu: str. The GPU the latency model priced.
        predicted: dict. Predicted latency in seconds of the scoring batch
            (`chosen`, `float`, and each precision everywhere it can
            go) or, for `cost="bits"`, effective weight bits.
        speedup_over_fp16: float. Predicted float16 latency / chosen.
        quantized_flops: float. Fraction of the FLOPs in quantized layers.
        effective_bits: float. Weight bits per weight (ModelOpt's measure).
        tried: list of dict. Each configuration measured: its index in the
            Lagrangian list, summed score, cost and metric drop.
        passes: dict. Passes over a batch: calibration, forward, backward
            (scoring) and evaluation.
        seconds: float. Wall time of the whole search.
        sensitivity: the `SensitivityReport`.
        metric_name: str. What `metric` measures (`"top-1 accuracy"`,
            `"accuracy at threshold 0.5 (...)"`, a metric function's
            name).

    Example:

    >>> qmodel, report = keras_mp.auto_quantize(model, x[:512], y[:512])
    >>> print(report)  # the precision of each layer, and why
    >>> report.speedup_over_fp16
    """

    rows: list
    metric_float: float
    metric: float
    max_drop: float
    cost: str
    gpu: str
    predicted: dict
    speedup_over_fp16: float
    quantized_flops: float
    effective_bits: float
    tried: list
    passes: dict
    seconds: float
    sensitivity: object = dataclasses.field(repr=False, default=None)
    metric_name: str = ""

    @property
    def drop(self):
        return self.metric_float - self.metric

    @property
    def choices(self):
        """`rows`, by its name before (for one release)."""
        warnings.warn(
            "AutoQuantizeReport.choices is now AutoQuantizeReport.rows; "
            "`choices` will be removed in the next release.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.rows

    def to_table(self):
        counts = {}
        for c in self.rows:
            counts[c.precision] = counts.get(c.precision, 0) + 1
        lines = [
            f"auto_quantize ({self.cost} on {self.gpu}): "
            f"{self.metric_name or 'metric'} "
            f"{self.metric:.4f} vs float {self.metric_float:.4f} (drop "
            f"{self.drop:.4f}, budget {self.max_drop:.4f}); "
            + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
            f"  predicted speed-up over float16 {self.speedup_over_fp16:.2f}x"
            f", {100 * self.quantized_flops:.1f}% of FLOPs quantized, "
            f"{self.effective_bits:.2f} effective weight bits",
            f"  search: {len(self.tried)} configurations measured, passes "
            + ", ".join(f"{k} {v}" for k, v in self.passes.items())
            + f", {self.seconds:.1f} s",
            f"  {'layer':<48} {'choice':<8} reason",
        ]
        for c in self.rows:
            lines.append(f"  {c.name[-48:]:<48} {c.precision:<8} {c.reason}")
        return "\n".join(lines)

    def __str__(self):
        return self.to_table()

    def to_dict(self):
        """The report as plain Python (JSON-ready)."""
        out = dataclasses.asdict(self)
        out["drop"] = self.drop
        out["sensitivity"] = (
            None if self.sensitivity is None else self.sensitivity.to_dict()
        )
        return out

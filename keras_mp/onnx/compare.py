"""Keras vs ONNX Runtime layer by layer: `compare_onnx` says where an
exported graph starts to disagree with the model (`docs/compare.md`)."""

import dataclasses
import os

from keras_mp import _inputs as _inputs_mod
from keras_mp._compat import optional_import, require_tensorflow
from keras_mp._models import check_graph_model
from keras_mp.onnx.compare_graph import Graph
from keras_mp.onnx.compare_graph import run as run_onnx
from keras_mp.onnx.compare_match import plan
from keras_mp.onnx.compare_rows import (  # noqa: F401 (LayerError: public here)
    LayerError,
    mark_rounding,
    rows_of,
    tolerances,
)
from keras_mp.onnx.compare_trace import exported_ranges, keras_values, trace
from keras_mp.onnx.parity import reference_only
from keras_mp.onnx.twin import float32_twin, half_compute_dtype
from keras_mp.quantization.legacy import check_current


@dataclasses.dataclass
class CompareReport:
    """Per-layer errors of an ONNX file against its Keras model.

    Attributes:
        samples: int. Inputs compared.
        rows: list of `LayerError`, in the order the calls finish.
        unmatched: list of (layer path, reason) for the layers not
            compared.
        max_steps: float. Tolerance at a Q/DQ, in quantization steps.
        max_rel_l2: float. Tolerance at a layer's output.
        precision: str. The float type of the ONNX graph, which set the
            default tolerances: `"float32"`, or `"float16"` for a graph
            exported with `dtype="float16"`.
        runtime: str. What ran the graph: `"ONNX Runtime"`, or
            `"onnx.reference"` for NVFP4/MXFP8 weights, which ONNX
            Runtime cannot dequantize (`parity.reference_only`).

    Example:

    >>> report = keras_mp.compare_onnx(qmodel, "model.onnx", x_test[:64])
    >>> print(report)  # the verdict, then one line per layer
    >>> report.first_divergence
    """

    samples: int
    rows: list
    unmatched: list
    max_steps: float
    max_rel_l2: float
    precision: str = "float32"
    runtime: str = "ONNX Runtime"

    @property
    def first_divergence(self):
        """The first `LayerError` past the tolerance, or None."""
        return next((r for r in self.rows if r.diverged), None)

    def to_dict(self):
        """The report as plain Python (JSON-ready)."""
        return dataclasses.asdict(self)

    def to_markdown(self):
        lines = [
            "| depth | layer | type | max abs | rel L2 | Q/DQ steps | |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in self.rows:
            steps = "" if r.steps is None else f"{r.steps:.2f}"
            verdict = "**diverged**" if r.diverged else ""
            verdict = "rounding" if r.rounding else verdict
            lines.append(
                f"| {r.depth} | {r.name} | {r.kind} | {r.max_abs:.3g} | "
                f"{r.rel_l2:.2e} | {steps} | {verdict} |"
            )
        return "\n".join(lines)

    def __str__(self):
        first = self.first_divergence
        rounding = [r.name for r in self.rows if r.rounding]
        verdict = (
            "no layer diverges"
            + (
                f" ({len(rounding)} past tolerance only through rounding "
                "flips: see 'Rounding' below)"
                if rounding
                else ""
            )
            if first is None
            else f"first divergence at layer {first.name!r} (depth "
            f"{first.depth}, ONNX tensor {first.tensor!r})"
        )
        text = [
            f"Keras vs {self.runtime} (optimizations off) on {self.samples} "
            f"inputs, {len(self.rows)} layers compared ({self.precision} "
            f"graph; tolerance: {self.max_steps:g} quantization step at a "
            f"Q/DQ, relative L2 {self.max_rel_l2:g} at a layer output): "
            f"{verdict}.",
            self.to_markdown(),
        ]
        if rounding:
            text.append(
                f"Rounding: {', '.join(rounding)} past tolerance only "
                "through one-step rounding flips at the Q/DQs before them "
                "(within it once Keras reads ONNX Runtime's values of "
                "those Q/DQs): float noise on a rounding boundary, not an "
                "export fault."
            )
        if self.unmatched:
            # One reason once, after the layers it holds for (the cells
            # of every recurrent layer share one).
            by_reason = {}
            for name, why in self.unmatched:
                by_reason.setdefault(why, []).append(name)
            text.append(
                "Not compared: "
                + "; ".join(
                    f"{', '.join(names)} ({why})"
                    for why, names in by_reason.items()
                )
            )
        return "\n".join(text)

    def plot(self, path, title=None):
        """Writes a PNG of the error by depth; see `plot_compare`."""
        from keras_mp.onnx.compare_plot import plot_compare

        return plot_compare(self, path, title=title)


def _inputs(model, data, samples):
    """`data` as a list of arrays, one per model input, checked and cast
    to each input's dtype (`keras_mp._inputs`), the first `samples`."""
    specs = _inputs_mod.input_specs(model, "compare_onnx")
    arrays = _inputs_mod.as_input_list(data, specs, "`data`")
    return [x[:samples] for x in arrays] if samples else arrays


def compare_onnx(
    model, onnx_path, data, samples=None, max_steps=None, max_rel_l2=None
):
    """Compares an exported ONNX file with its Keras model layer by layer.

    Every layer inside the model is reached: the layers of nested models,
    the layers inside custom layers and keras-hub backbones, the layers of
    a `keras_mp.RecordedModel` (`compare_trace.reachable`). The
    model is traced as the export traced it, with each layer call's
    output fetched; tf2onnx named the ONNX tensors after the same
    TensorFlow name scopes, so each call is matched to the ONNX tensor of
    the same name, else to the last float tensor of its scope whose shape
    fits (NHWC, or NCHW where the export moved the layout). Those tensors
    are made graph outputs of an in-memory copy of the graph, which ONNX
    Runtime runs with graph optimizations off (Q/DQ semantics). Each
    activation Q/DQ (the input quantizers of quantized layers, stand-alone
    `QuantizeActivation` layers) is compared in quantization steps
    (`amax / 127` for 8 bits): a rounding flip is one step, more is a
    bug. A recurrent layer (`LSTM`, `GRU`, `SimpleRNN`, each layer of a
    `Bidirectional`, each state of `return_state`) is compared with the
    outputs of its ONNX `LSTM`/`GRU`/`RNN` op or `Loop`, read per
    direction, in reverse time order or with the two directions merged
    as Keras does; its cell, which runs inside that op or loop, is
    listed as not compared.

    Rows come in the order the calls finish (a layer's inner layers
    before it), so the first row past a tolerance is where ONNX and Keras
    part. A row past tolerance only through one-step flips at Q/DQs
    before it (within it once Keras is traced again with those Q/DQs
    returning ONNX Runtime's values) is marked `rounding`, not diverged.

    Nothing is left out silently: a layer never called at inference, one
    with no ONNX tensor of its own (an embedding folded into a constant),
    or one whose tensors tf2onnx renamed is listed in `unmatched` with the
    reason. Weight quantizers are not rows: their Q/DQ is an INT8
    initializer, checked at their layer's output.

    Args:
        model: a Sequential or Functional `keras.Model` (a
            `keras_mp.RecordedModel` included), called: the model that was
            exported.
        onnx_path: str. The file `keras_mp.export_onnx` wrote for `model`.
        data: NumPy array of inputs; for several inputs, a list in
            `model.inputs` order or a dict by input name.
        samples: int. Compare on the first `samples` inputs only. Defaults
            to None (all).
        max_steps: float. A Q/DQ whose error is more than this many
            quantization steps diverges (up to float32 rounding of the
            step: a one-step rounding flip does not, at 1.0). A step is
            the distance between neighbouring codes of the quantizer's
            format where the values lie (`NumberFormat.local_step`):
            `amax / 127` for INT8, from `amax / 448 / 512` near 0 to
            `32 * amax / 448` near `amax` for FP8 E4M3. Defaults to
            None: 1.0 for a float32 graph, 1.124 for a float16 one (a
            flip plus the float16 rounding of the scale and the output,
            127 * 2**-11 step each).
        max_rel_l2: float. A layer output whose relative L2 error exceeds
            this diverges. Defaults to None: 1e-3 for a float32 graph,
            1e-2 for a float16 one (`export_onnx(dtype="float16")`), whose
            activations carry float16 rounding.

    A model whose layers compute in float16 or bfloat16 is compared as
    `export_onnx` exported it: through its float32 twin
    (`keras_mp.onnx.twin.float32_twin`). A float16 graph
    (`export_onnx(dtype="float16")`) is compared with Keras quantizing on
    the scales it stores (raised to float16's smallest normal number,
    `keras_mp.onnx.subnormal`); a relative error counts values below that
    number as that number; and its rounding, carried from Q/DQ to Q/DQ,
    is marked `rounding` as a flip is. A bfloat16 graph is refused:
    ONNX Runtime cannot run its Q/DQ.

    Returns:
        `CompareReport` (`.rows`, `.first_divergence`, `.to_dict()`,
        `.to_markdown()`, `.plot(path)`).

    Raises:
        TypeError: not a Sequential or Functional Keras model.
        ValueError: the model was never called, `data` does not fit its
            inputs, the ONNX file is not an export of this model or is a
            bfloat16 graph, or the model holds layers of an earlier
            keras_mp (`keras_mp.upgrade` first).
        FileNotFoundError: no file at `onnx_path`.

    Example:

    >>> report = keras_mp.compare_onnx(qmodel, "model.onnx", x_test[:64])
    >>> print(report.first_divergence)
    """
    require_tensorflow("keras_mp.compare_onnx")
    onnx = optional_import("onnx")
    check_graph_model(
        model,
        "compare_onnx",
        "Wrap it in a functional model: `x = keras.Input(shape); "
        "keras.Model(x, model(x))`.",
    )
    check_current(model, "compare_onnx")  # old wrappers: upgrade first
    if not model.built or not model.inputs:
        raise ValueError(
            f"Model {model.name!r} has never been called, so it has no "
            "layer outputs to compare. Build it with `keras.Input(...)` or "
            "call it once on a batch."
        )
    inputs = _inputs(model, data, samples)
    onnx_path = os.fspath(onnx_path)
    if not os.path.isfile(onnx_path):
        raise FileNotFoundError(f"ONNX file not found: {onnx_path}")
    proto = onnx.load(onnx_path)
    graph_inputs = [i for i in proto.graph.input if i.name not in _inits(proto)]
    if len(graph_inputs) != len(inputs):
        raise ValueError(
            f"{onnx_path} has {len(graph_inputs)} input(s) but model "
            f"{model.name!r} has {len(inputs)}: it is not an export of this "
            "model. Export it with keras_mp.export_onnx(model, path)."
        )
    graph = Graph(proto)
    if graph.bfloat16:
        raise ValueError(
            f"{onnx_path} is a bfloat16 graph (export_onnx(dtype='bfloat16'))"
            ": ONNX Runtime's CPU provider cannot run its bfloat16 Q/DQ, so "
            "its layers cannot be read. Compare the float32 export "
            "(export_onnx(model, path)) or the float16 one (dtype='float16'),"
            " whose Q/DQ placement is the same."
        )
    specs = _inputs_mod.input_specs(model, "compare_onnx")
    # export_onnx traced the float32 twin of a 16-bit model: that is what
    # the graph computes, so that is what its layers are compared with.
    traced = float32_twin(model) if half_compute_dtype(model) else model
    tolerance = tolerances(graph, max_steps, max_rel_l2)
    # A float16 graph quantizes on scales raised to float16's smallest
    # normal: the Keras side takes them while it runs.
    with exported_ranges(traced, graph.tiny):
        return _report(traced, specs, inputs, onnx_path, graph, tolerance)


def _report(traced, specs, inputs, onnx_path, graph, tolerance):
    """The `CompareReport` of `traced` (its ranges as the graph's) on
    `inputs` against the ONNX graph."""
    run, calls, never = trace(traced, specs)
    values = keras_values(run, inputs)
    matched, unmatched = plan(graph, calls, values)
    unmatched = [(path, why) for _, path, why in never] + unmatched
    if not matched:
        raise ValueError(
            f"No layer of model {traced.name!r} appears in {onnx_path}: it "
            "is not an export of this model. Export it with "
            "keras_mp.export_onnx(model, path)."
        )
    wanted = [t for _, _, views in matched for t, _ in views]
    got = run_onnx(graph.proto, graph, list(dict.fromkeys(wanted)), inputs)

    rows, lost, qdqs = rows_of(matched, values, graph, got, tolerance)
    if any(r.diverged for r in rows):
        fit = (matched, graph, got, tolerance)
        mark_rounding(traced, specs, inputs, rows, qdqs, fit)
    return CompareReport(
        len(inputs[0]),
        rows,
        unmatched + lost,
        *tolerance,
        graph.precision,
        "onnx.reference" if reference_only(graph.proto) else "ONNX Runtime",
    )


def _inits(proto):
    return {i.name for i in proto.graph.initializer}

"""Keras vs ONNX Runtime layer by layer: `compare_onnx` says where an
exported graph starts to disagree with the model (`docs/compare.md`)."""

import dataclasses
import os

from keras_mp import _inputs as _inputs_mod
from keras_mp._compat import optional_import
from keras_mp._models import check_graph_model
from keras_mp.onnx.compare_graph import Graph, best_layout
from keras_mp.onnx.compare_graph import run as run_onnx
from keras_mp.onnx.compare_match import is_qdq, plan, step
from keras_mp.onnx.compare_trace import keras_values, trace
from keras_mp.onnx.twin import float32_twin, half_compute_dtype
from keras_mp.quantization.legacy import check_current


@dataclasses.dataclass
class LayerError:
    """ONNX Runtime against Keras at one layer's output.

    Attributes:
        depth: int. The position of the layer call among all the calls
            of the trace, in the order they finish.
        name: str. The layer's path of names from the model down
            (`vi_t_backbone/vit_encoder/transformer_block_1/mha/query`; its name
            for a layer of the model itself), `(call 2)` added for a
            layer's second call.
        kind: str. Its type (`QuantizedDense` for a quantized layer).
        tensor: str. The ONNX tensor compared with the layer's output.
        max_abs: float. Max absolute difference.
        rel_l2: float. `||onnx - keras|| / ||keras||`.
        steps: float or None. At an activation quantizer (a Q/DQ of its
            own, which is judged by this only), the difference of its
            output in quantization steps (`amax / 127` for 8 bits); None
            elsewhere.
        diverged: bool. Past the report's tolerance.
        rounding: bool. Past the tolerance, but only through one-step
            rounding flips at Q/DQs before it: within it once Keras is
            fed ONNX Runtime's values of those Q/DQs (`diverged` False).
    """

    depth: int
    name: str
    kind: str
    tensor: str
    max_abs: float
    rel_l2: float
    steps: float = None
    diverged: bool = False
    rounding: bool = False


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
            exported with `fp16=True`.
    """

    samples: int
    rows: list
    unmatched: list
    max_steps: float
    max_rel_l2: float
    precision: str = "float32"

    @property
    def first_divergence(self):
        """The first `LayerError` past the tolerance, or None."""
        return next((r for r in self.rows if r.diverged), None)

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
            f"Keras vs ONNX Runtime (optimizations off) on {self.samples} "
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


def _kind(layer):
    return type(layer).__name__


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
            step: a one-step rounding flip does not, at 1.0). Defaults to
            None: 1.0 for a float32 graph, 1.124 for a float16 one (a
            flip plus the float16 rounding of the scale and the output,
            127 * 2**-11 step each).
        max_rel_l2: float. A layer output whose relative L2 error exceeds
            this diverges. Defaults to None: 1e-3 for a float32 graph,
            1e-2 for a float16 one (`export_onnx(fp16=True)`), whose
            activations carry float16 rounding.

    A model whose layers compute in float16 or bfloat16 is compared as
    `export_onnx` exported it: through its float32 twin
    (`keras_mp.onnx.twin.float32_twin`).

    Returns:
        `CompareReport` (`.rows`, `.first_divergence`, `.to_markdown()`,
        `.plot(path)`).

    Raises:
        TypeError: not a Sequential or Functional Keras model.
        ValueError: the model was never called, `data` does not fit its
            inputs, the ONNX file is not an export of this model, or the
            model holds layers of an earlier keras_mp (`keras_mp.upgrade`
            first).
        FileNotFoundError: no file at `onnx_path`.

    Example:

    >>> report = keras_mp.compare_onnx(qmodel, "model.onnx", x_test[:64])
    >>> print(report.first_divergence)
    """
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
    specs = _inputs_mod.input_specs(model, "compare_onnx")
    # export_onnx traced the float32 twin of a 16-bit model: that is what
    # the graph computes, so that is what its layers are compared with.
    traced = float32_twin(model) if half_compute_dtype(model) else model
    run, calls, never = trace(traced, specs)
    values = keras_values(run, inputs)
    graph = Graph(proto)
    precision = "float16" if graph.float16 else "float32"
    max_steps = _TOLERANCES[precision][0] if max_steps is None else max_steps
    if max_rel_l2 is None:
        max_rel_l2 = _TOLERANCES[precision][1]

    matched, unmatched = plan(graph, calls, values)
    unmatched = [(path, why) for _, path, why in never] + unmatched
    if not matched:
        raise ValueError(
            f"No layer of model {model.name!r} appears in {onnx_path}: it "
            "is not an export of this model. Export it with "
            "keras_mp.export_onnx(model, path)."
        )
    wanted = [t for _, _, views in matched for t, _ in views]
    got = run_onnx(proto, graph, list(dict.fromkeys(wanted)), inputs)

    tolerance = (max_steps, max_rel_l2)
    rows, lost, qdqs = _rows(matched, values, graph, got, tolerance)
    if any(r.diverged for r in rows):
        fit = (matched, graph, got, tolerance)
        _mark_rounding(traced, specs, inputs, rows, qdqs, fit)
    return CompareReport(
        len(inputs[0]), rows, unmatched + lost, max_steps, max_rel_l2, precision
    )


def _rows(matched, values, graph, got, tolerance, names=None):
    """(`LayerError` rows, (path, why) for the calls no tensor fitted,
    ONNX Runtime's value of each Q/DQ row in Keras' layout by name).
    `values` are indexed as `names[call.name]` when given (a later
    trace), else by `call.output`."""
    rows, unmatched, qdqs = [], [], {}
    for depth, call, views in matched:
        index = call.output if names is None else names.get(call.name)
        if index is None:
            continue
        want = values[index]
        found = [
            (fit, f"{t} ({label})" if label else t)
            for t, label in views
            if (fit := best_layout(graph.view(t, label, got[t]), want))
            is not None
        ]
        if not found:
            unmatched.append(
                (
                    call.name,
                    "no ONNX tensor of its output's size (tried "
                    + ", ".join(
                        repr(t) for t in dict.fromkeys(t for t, _ in views)
                    )
                    + ")",
                )
            )
            continue
        (err, layout), tensor = min(found, key=lambda f: f[0][0][1])
        layer, steps, qdq = call.layer, None, False
        if is_qdq(layer):
            qdq = True
            steps = err[0] / step(layer)
            qdqs[call.name] = layout
        # A Q/DQ's output is judged in steps only: flips of single values
        # are rounding, however many there are.
        rel_l2 = None if qdq else err[1]
        diverged = _diverged(rel_l2, steps, *tolerance)
        rows.append(
            LayerError(
                depth, call.name, _kind(layer), tensor, *err, steps, diverged
            )
        )
    return rows, unmatched, qdqs


# Passes of `_mark_rounding`: each feeds Keras the Q/DQs that flipped in
# the last one, whose flips may move the Q/DQs after them.
_ROUNDING_PASSES = 4


def _mark_rounding(traced, specs, inputs, rows, qdqs, fit):
    """Marks `rounding` the diverged rows that only one-step rounding
    flips upstream explain: Keras is traced again with each Q/DQ that
    flipped (a whole step off, within `max_steps`) returning ONNX
    Runtime's value instead of its own, so the layers after it read
    the inputs ONNX's did; a row within tolerance then is rounding
    carried forward, not an export fault (a wrong weight, scale or op
    still diverges). Repeated while new Q/DQs flip."""
    matched, graph, got, tolerance = fit
    fed, current = set(), rows
    for _ in range(_ROUNDING_PASSES):
        flipped = fed | {
            r.name
            for r in current
            if r.steps is not None and not r.diverged and r.steps >= 0.5
        }
        if flipped == fed:
            break
        fed = flipped
        inject = [(r.name, qdqs[r.name]) for r in rows if r.name in fed]
        run, calls, _ = trace(traced, specs, inject)
        values = keras_values(run, inputs + [v for _, v in inject])
        names = {c.name: c.output for c in calls}
        current, _, _ = _rows(matched, values, graph, got, tolerance, names)
    if not fed:
        return
    within = {r.name for r in current if not r.diverged}
    for row in rows:
        if row.diverged and row.name in within:
            row.diverged, row.rounding = False, True


# (max_steps, max_rel_l2) by the graph's float type. A float16 graph
# (`export_onnx(fp16=True)`) rounds every activation to 11 significant
# bits (a relative error up to 2**-11 per op, which adds up over layers),
# and a Q/DQ's scale and output too: each moves a code of 127 by up to
# 127 * 2**-11 = 0.06 step, on top of a rounding flip.
_FLOAT16_STEPS = 1.0 + 2 * 127 * 2.0**-11
_TOLERANCES = {"float32": (1.0, 1e-3), "float16": (_FLOAT16_STEPS, 1e-2)}

# A one-step rounding flip measures 1 step only up to float32 rounding of
# the step itself (1.0000008, say): not a divergence at max_steps=1.
_STEP_SLACK = 1e-3


def _diverged(rel_l2, steps, max_steps, max_rel_l2):
    """Past a tolerance: `rel_l2` (None: not judged) or `steps`."""
    return (rel_l2 is not None and rel_l2 > max_rel_l2) or (
        steps is not None and steps > max_steps + _STEP_SLACK
    )


def _inits(proto):
    return {i.name for i in proto.graph.initializer}

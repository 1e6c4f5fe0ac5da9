"""Keras vs ONNX Runtime layer by layer: `compare_onnx` says where an
exported graph starts to disagree with the model (`docs/compare.md`)."""

import dataclasses
import os

import numpy as np

from keras_mp import _inputs as _inputs_mod
from keras_mp._compat import optional_import
from keras_mp._models import check_graph_model
from keras_mp.onnx.parity import ort_session, run_session
from keras_mp.quantization.layers import QuantizeWrapper
from keras_mp.quantization.quantizers import fake_quant

_FLOAT_TYPES = (1, 10, 11)  # onnx.TensorProto FLOAT, FLOAT16, DOUBLE


@dataclasses.dataclass
class LayerError:
    """ONNX Runtime against Keras at one layer's output.

    Attributes:
        depth: int. The layer's position in `model.layers`.
        name: str. The Keras layer.
        kind: str. Its type (`QuantizeWrapper(Conv2D)` for a wrapper).
        tensor: str. The ONNX tensor compared with the layer's output.
        max_abs: float. Max absolute difference.
        rel_l2: float. `||onnx - keras|| / ||keras||`.
        steps: float or None. At a quantized layer, the max difference of
            its input Q/DQ in quantization steps (`amax / 127` for 8 bits);
            None for float layers.
        diverged: bool. Past the report's tolerance.
    """

    depth: int
    name: str
    kind: str
    tensor: str
    max_abs: float
    rel_l2: float
    steps: float = None
    diverged: bool = False


@dataclasses.dataclass
class CompareReport:
    """Per-layer errors of an ONNX file against its Keras model.

    Attributes:
        samples: int. Inputs compared.
        rows: list of `LayerError`, in layer order.
        unmatched: list of (layer name, reason) for the layers not compared.
        max_steps: float. Tolerance at a Q/DQ, in quantization steps.
        max_rel_l2: float. Tolerance at a layer's output.
    """

    samples: int
    rows: list
    unmatched: list
    max_steps: float
    max_rel_l2: float

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
            lines.append(
                f"| {r.depth} | {r.name} | {r.kind} | {r.max_abs:.3g} | "
                f"{r.rel_l2:.2e} | {steps} | "
                f"{'**diverged**' if r.diverged else ''} |"
            )
        return "\n".join(lines)

    def __str__(self):
        first = self.first_divergence
        verdict = (
            "no layer diverges"
            if first is None
            else f"first divergence at layer {first.name!r} (depth "
            f"{first.depth}, ONNX tensor {first.tensor!r})"
        )
        text = [
            f"Keras vs ONNX Runtime (optimizations off) on {self.samples} "
            f"inputs, {len(self.rows)} layers compared (tolerance: "
            f"{self.max_steps:g} quantization step at a Q/DQ, relative L2 "
            f"{self.max_rel_l2:g} at a layer output): {verdict}.",
            self.to_markdown(),
        ]
        if self.unmatched:
            text.append(
                "Not compared: "
                + "; ".join(f"{n} ({why})" for n, why in self.unmatched)
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


def _probe(model, layers):
    """Traces `model.inputs -> [each layer's output and inputs]`.

    Returns the traced function and, per probe output, its TensorFlow
    name scope below the root: the one tf2onnx names that layer's ONNX
    nodes after (the trace uniquifies scopes the way an export's does).
    """
    import keras
    import tensorflow as tf

    outputs, index = [], []
    for layer in layers:
        outputs.append(layer.output)
        if isinstance(layer, QuantizeWrapper) and layer.input_quantizers:
            ins = layer.input
            ins = list(ins) if isinstance(ins, (list, tuple)) else [ins]
            outputs += [ins[i] for i in layer.input_indices]
        index.append(len(outputs))
    probe = keras.Model(model.inputs, outputs, name="compare_probe")
    scopes = []
    signature = [
        tf.TensorSpec((None,) + tuple(t.shape[1:]), t.dtype)
        for t in model.inputs
    ]

    @tf.function(input_signature=signature)
    def run(*inputs):
        outs = probe(
            list(inputs) if len(inputs) > 1 else inputs[0], training=False
        )
        scopes[:] = [o.name.split("/") for o in outs]
        return outs

    run.get_concrete_function()
    return run, scopes, index


def _keras_values(run, inputs, batch_size=256):
    chunks = [
        [np.asarray(o) for o in run(*[x[i : i + batch_size] for x in inputs])]
        for i in range(0, len(inputs[0]), batch_size)
    ]
    return [np.concatenate(c) for c in zip(*chunks)]


def _fits(shape, want):
    """Whether an ONNX static shape can hold a Keras output shape (NHWC, or
    NCHW after tf2onnx's transpose optimizer, or with size-1 axes)."""
    if shape is None:
        return True
    keep = [d for d in want[1:] if d != 1]
    nchw = (want[0], want[-1]) + tuple(want[1:-1])
    for d_shape, d_want in ((shape, want), (shape, nchw)):
        if len(d_shape) == len(d_want) and all(
            a is None or a == b for a, b in zip(d_shape[1:], d_want[1:])
        ):
            return True
    return [d for d in shape[1:] if d != 1] == keep


def _error(got, want):
    """(max abs, rel L2) with `got` brought to `want`'s layout, the best
    over the layouts that fit; None when none does."""
    options = []
    if got.shape == want.shape:
        options.append(got)
    if got.ndim == want.ndim >= 3:
        nhwc = np.moveaxis(got, 1, -1)
        if nhwc.shape == want.shape:
            options.append(nhwc)
    if not options and got.size == want.size:
        if [d for d in got.shape if d != 1] == [
            d for d in want.shape if d != 1
        ]:
            options.append(got.reshape(want.shape))
    best = None
    norm = max(float(np.linalg.norm(want)), 1e-12)
    for g in options:
        diff = np.abs(g.astype(np.float64) - want)
        err = (float(diff.max()), float(np.linalg.norm(diff)) / norm)
        best = err if best is None or err[1] < best[1] else best
    return best


class _Graph:
    """The ONNX graph's nodes grouped by the Keras layer scope they carry."""

    def __init__(self, proto):
        onnx = optional_import("onnx")
        inferred = onnx.shape_inference.infer_shapes(proto).graph
        self.types = {}
        for info in list(inferred.value_info) + list(inferred.output):
            t = info.type.tensor_type
            dims = tuple(
                d.dim_value if d.HasField("dim_value") else None
                for d in t.shape.dim
            )
            self.types[info.name] = (
                t.elem_type,
                dims if t.HasField("shape") else None,
            )
        self.initializers = {i.name for i in proto.graph.initializer}
        self.groups = {}
        for node in proto.graph.node:
            scopes = {_scope(node.name)} | {_scope(o) for o in node.output}
            for scope in scopes - {None}:
                self.groups.setdefault(scope, []).append(node)

    def float_outputs(self, scope):
        """The float tensors the scope's nodes produce, last first."""
        found = []
        for node in reversed(self.groups.get(scope, [])):
            for out in node.output:
                elem, shape = self.types.get(out, (None, None))
                if elem in _FLOAT_TYPES:
                    found.append((out, shape))
        return found

    def activation_dqs(self, scope):
        return [
            n.output[0]
            for n in self.groups.get(scope, [])
            if n.op_type == "DequantizeLinear"
            and n.input[0] not in self.initializers
        ]


def _scope(name):
    parts = name.split("/")
    return parts[1] if len(parts) > 2 else None


def _kind(layer):
    if isinstance(layer, QuantizeWrapper):
        return f"QuantizeWrapper({type(layer.layer).__name__})"
    return type(layer).__name__


def compare_onnx(
    model, onnx_path, data, samples=None, max_steps=1.0, max_rel_l2=1e-3
):
    """Compares an exported ONNX file with its Keras model layer by layer.

    Every layer of `model.layers` is matched to the ONNX tensors tf2onnx
    named after it (their names start with the layer's TensorFlow name
    scope); the last float tensor of the group whose shape fits the
    layer's output (NHWC, or NCHW where the export moved the layout) is
    made a graph output of an in-memory copy of the graph, which ONNX
    Runtime runs with graph optimizations off (Q/DQ semantics). At a
    quantized layer the input Q/DQ is compared too, in quantization steps
    (`amax / 127` for 8 bits): a rounding flip is one step, more is a bug.
    The first layer past a tolerance is where ONNX and Keras part.

    Layers of a nested model are compared as one (the outer layer); a
    layer with no ONNX nodes of its own (`Dropout` at inference, say) is
    listed in `unmatched` with the reason.

    Args:
        model: a Sequential or Functional `keras.Model`, called.
        onnx_path: str. The file `keras_mp.export_onnx` wrote for `model`.
        data: NumPy array of inputs; for several inputs, a list in
            `model.inputs` order or a dict by input name.
        samples: int. Compare on the first `samples` inputs only. Defaults
            to None (all).
        max_steps: float. A Q/DQ whose error is more than this many
            quantization steps diverges (up to float32 rounding of the
            step: a one-step rounding flip does not, at 1.0). Defaults to
            1.0.
        max_rel_l2: float. A layer output whose relative L2 error exceeds
            this diverges. Defaults to 1e-3.

    Returns:
        `CompareReport` (`.rows`, `.first_divergence`, `.to_markdown()`,
        `.plot(path)`).

    Raises:
        TypeError: not a Sequential or Functional Keras model.
        ValueError: the model was never called, `data` does not fit its
            inputs, or the ONNX file is not an export of this model.
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
    import keras

    layers = [
        layer
        for layer in model.layers
        if not isinstance(layer, keras.layers.InputLayer)
    ]
    run, scopes, index = _probe(model, layers)
    values = _keras_values(run, inputs)
    graph = _Graph(proto)

    plan, unmatched, claimed = [], [], set()
    for k, layer in enumerate(layers):
        start = index[k - 1] if k else 0
        parts = scopes[start]
        scope = parts[1] if len(parts) > 2 else None
        want = values[start]
        if scope is None or scope in claimed:
            unmatched.append((layer.name, "no operations of its own"))
            continue
        claimed.add(scope)
        tensor = next(
            (
                name
                for name, shape in graph.float_outputs(scope)
                if _fits(shape, want.shape)
            ),
            None,
        )
        if tensor is None:
            why = (
                "no ONNX node carries its name"
                if scope not in graph.groups
                else "no ONNX tensor of its output's shape"
            )
            unmatched.append((layer.name, why))
            continue
        plan.append((k, layer, scope, tensor, start))
    if not plan:
        raise ValueError(
            f"No layer of model {model.name!r} appears in {onnx_path}: it "
            "is not an export of this model. Export it with "
            "keras_mp.export_onnx(model, path)."
        )
    wanted = [t for _, _, _, t, _ in plan]
    for _, layer, scope, _, _ in plan:
        if isinstance(layer, QuantizeWrapper):
            wanted += graph.activation_dqs(scope)
    got = _run(proto, graph, list(dict.fromkeys(wanted)), inputs)

    rows = []
    for k, layer, scope, tensor, start in plan:
        err = _error(got[tensor], values[start])
        if err is None:
            unmatched.append((layer.name, f"ONNX tensor {tensor!r} shape"))
            continue
        steps = None
        if isinstance(layer, QuantizeWrapper) and layer.input_quantizers:
            steps = _qdq_steps(layer, graph, scope, got, values[start + 1 :])
        diverged = _diverged(err[1], steps, max_steps, max_rel_l2)
        rows.append(
            LayerError(
                k, layer.name, _kind(layer), tensor, *err, steps, diverged
            )
        )
    return CompareReport(len(inputs[0]), rows, unmatched, max_steps, max_rel_l2)


# A one-step rounding flip measures 1 step only up to float32 rounding of
# the step itself (1.0000008, say): not a divergence at max_steps=1.
_STEP_SLACK = 1e-3


def _diverged(rel_l2, steps, max_steps, max_rel_l2):
    return rel_l2 > max_rel_l2 or (
        steps is not None and steps > max_steps + _STEP_SLACK
    )


def _inits(proto):
    return {i.name for i in proto.graph.initializer}


def _qdq_steps(layer, graph, scope, got, keras_inputs):
    """Max error of the layer's input Q/DQ outputs in quantization steps;
    each ONNX DQ is matched to the quantized Keras input it fits best."""
    quantized = []
    for q, x in zip(layer.input_quantizers, keras_inputs):
        amax = float(q.amax.numpy())
        fq = np.asarray(fake_quant(x, amax, num_bits=q.num_bits))
        quantized.append((fq, amax / (2 ** (q.num_bits - 1) - 1)))
    worst = None
    for dq in graph.activation_dqs(scope):
        fits = [
            (e[0] / step)
            for fq, step in quantized
            if (e := _error(got[dq], fq)) is not None
        ]
        if fits:
            worst = max(worst or 0.0, min(fits))
    return worst


def _run(proto, graph, tensors, inputs):
    """ONNX Runtime's values of `tensors`, made outputs of a copy of
    `proto`."""
    import tempfile

    onnx = optional_import("onnx")
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    del copy.graph.output[:]
    for name in tensors:
        elem, _ = graph.types[name]
        copy.graph.output.append(
            onnx.helper.make_tensor_value_info(name, elem, None)
        )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "compare.onnx")
        onnx.save(copy, path)
        outs = run_session(ort_session(path, optimized=False), inputs)
    return dict(zip(tensors, outs))

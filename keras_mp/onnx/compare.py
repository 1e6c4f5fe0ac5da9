"""Keras vs ONNX Runtime layer by layer: `compare_onnx` says where an
exported graph starts to disagree with the model (`docs/compare.md`)."""

import contextlib
import dataclasses
import itertools
import math
import os

import numpy as np

from keras_mp import _inputs as _inputs_mod
from keras_mp._compat import optional_import
from keras_mp._models import check_graph_model, walk_layers
from keras_mp.onnx.parity import ort_session, run_session
from keras_mp.quantization.layers import QuantizeActivation, QuantizeWrapper
from keras_mp.quantization.quantizers import fake_quant
from keras_mp.quantization.twins import WeightQuantizer

_FLOAT_TYPES = (1, 10, 11)  # onnx.TensorProto FLOAT, FLOAT16, DOUBLE
_NOT_CALLED = "not called when the model runs at inference"


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


@dataclasses.dataclass
class _Call:
    """One layer call seen while tracing the model: where its output (and,
    for a `QuantizeWrapper`, its quantized inputs) sit among the traced
    function's outputs."""

    layer: object
    name: str
    scope: str
    tensor: str
    output: int
    inputs: tuple = ()


def _reachable(model):
    """(layer, path) for every layer inside `model` a report can compare:
    nested models and the layers inside custom layers included, a
    `QuantizeWrapper` as one layer, input layers and weight quantizers (a
    weight's Q/DQ is an initializer, checked at its layer's output) left
    out. Paths are the names from the model down, made unique."""
    import keras

    found, paths = [], set()
    for layer, parents in walk_layers(
        model,
        include_models=True,
        stop_at=(QuantizeWrapper,),
        with_parents=True,
    ):
        if isinstance(layer, (keras.layers.InputLayer, WeightQuantizer)):
            continue
        path = base = "/".join(p.name for p in parents + (layer,))
        k = 1
        while path in paths:  # keras-hub repeats names (`dropout`)
            k += 1
            path = f"{base} #{k}"
        paths.add(path)
        found.append((layer, path))
    return found


@contextlib.contextmanager
def _recording(layers, calls, fetched, graph):
    """Within the block, each layer's `call` also appends its output (its
    first floating tensor) to `fetched` and a `_Call` to `calls`, in the
    order the calls finish (inner layers before the layer holding them)."""
    import keras
    import tensorflow as tf

    count = {}

    def hook(layer, path, call):
        def recorded(*args, **kwargs):
            out = call(*args, **kwargs)
            floats = [
                t
                for t in keras.tree.flatten(out)
                if tf.is_tensor(t) and t.dtype.is_floating
            ]
            if not floats or getattr(floats[0], "graph", None) is not graph:
                return out  # a symbolic call, or inside a control-flow branch
            count[id(layer)] = n = count.get(id(layer), 0) + 1
            name = path if n == 1 else f"{path} (call {n})"
            fetched.append(floats[0])
            output = len(fetched) - 1
            if isinstance(layer, QuantizeWrapper) and layer.input_quantizers:
                x = args[0] if args else next(iter(kwargs.values()))
                x = list(x) if isinstance(x, (list, tuple)) else [x]
                fetched.extend(x[i] for i in layer.input_indices)
            scope = tf.get_current_name_scope()
            calls.append(
                _Call(
                    layer,
                    name,
                    scope,
                    floats[0].name,
                    output,
                    tuple(range(output + 1, len(fetched))),
                )
            )
            return out

        return recorded

    for layer, path in layers:
        object.__setattr__(layer, "call", hook(layer, path, layer.call))
    try:
        yield
    finally:
        for layer, _ in layers:
            object.__delattr__(layer, "call")


def _trace(model, specs):
    """Traces `model` as `export_onnx` does, with every reachable layer's
    output made an output of the traced function.

    The trace calls the model exactly as the export's did, so TensorFlow
    names its ops the same way (Keras opens one name scope per layer
    call, and TF uniquifies them in the same order): tf2onnx named the
    ONNX nodes after those ops, which is how a layer finds its tensors.

    Returns:
        The traced `tf.function`, the `_Call`s, and the (layer, path)
        pairs that no call reached.
    """
    import tensorflow as tf

    layers = _reachable(model)
    calls = []
    signature = [
        tf.TensorSpec((None,) + tuple(s.shape[1:]), s.dtype, name=s.name)
        for s in specs
    ]

    @tf.function(input_signature=signature)
    def run(*inputs):
        fetched = []
        calls.clear()
        graph = tf.compat.v1.get_default_graph()
        with _recording(layers, calls, fetched, graph):
            model(_inputs_mod.call_arg(model, inputs, specs), training=False)
        return fetched

    run.get_concrete_function()
    called = {id(c.layer) for c in calls}
    never = [(layer, path) for layer, path in layers if id(layer) not in called]
    return run, calls, never


def _keras_values(run, inputs, batch_size=256):
    chunks = [
        [np.asarray(o) for o in run(*[x[i : i + batch_size] for x in inputs])]
        for i in range(0, len(inputs[0]), batch_size)
    ]
    return [np.concatenate(c) for c in zip(*chunks)]


def _fits(shape, want):
    """Whether an ONNX static shape can hold a Keras output shape: the same
    axes in any order (NCHW after tf2onnx's transpose optimizer, say), with
    size-1 axes left out, or the batch merged with the leading axes (a
    MatMul on `(batch * tokens, features)`)."""
    if shape is None:
        return True
    if len(shape) == len(want) and all(
        a is None or a in want[1:] for a in shape[1:]
    ):
        return True
    if [d for d in shape[1:] if d != 1] == [d for d in want[1:] if d != 1]:
        return True
    known = [d for d in shape[1:] if d is not None]
    return (
        len(known) == len(shape) - 1
        and math.prod(want[1:]) % max(math.prod(known), 1) == 0
    )


def _layouts(got, want):
    """`got` brought to `want`'s shape every way that keeps the values: its
    non-batch axes permuted (NCHW, a transposed attention matrix), or
    reshaped when it holds the same number of values."""
    options = []
    rest = range(1, got.ndim)
    if got.ndim == want.ndim:
        for order in itertools.permutations(rest):
            if tuple(got.shape[i] for i in order) == want.shape[1:]:
                options.append(np.transpose(got, (0, *order)))
    if not options and got.size == want.size:
        options.append(got.reshape(want.shape))
    return options


def _error(got, want):
    """(max abs, rel L2) with `got` brought to `want`'s layout, the best
    over the layouts that fit (`_layouts`); None when none does."""
    best = None
    norm = max(float(np.linalg.norm(want)), 1e-12)
    for g in _layouts(got, want):
        diff = np.abs(g.astype(np.float64) - want)
        err = (float(diff.max()), float(np.linalg.norm(diff)) / norm)
        best = err if best is None or err[1] < best[1] else best
    return best


class _Graph:
    """The ONNX graph's tensor types, and its nodes grouped by every name
    scope their names (or their outputs' names) lie in: a layer's group
    holds the nodes of the layers inside it too."""

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
            scopes = set()
            for name in (node.name, *node.output):
                parts = name.split("/")
                scopes.update("/".join(parts[:k]) for k in range(1, len(parts)))
            for scope in scopes:
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


def _match(graph, call, shape):
    """(the ONNX tensor holding `call`'s output, None), or (None, why not).

    The tensor of the same TensorFlow name when tf2onnx kept it; else the
    last float tensor of a fitting shape among the nodes of the scope that
    produced the output (a layer returning its input points to its
    producer), then among the nodes of the layer's own scope.
    """
    elem, dims = graph.types.get(call.tensor, (None, None))
    if elem in _FLOAT_TYPES and _fits(dims, shape):
        return call.tensor, None
    producer = call.tensor.rsplit("/", 1)[0]
    for scope in dict.fromkeys((producer, call.scope)):
        for name, dims in graph.float_outputs(scope):
            if _fits(dims, shape):
                return name, None
    if call.scope not in graph.groups:
        return None, (
            "no ONNX node carries its name (folded into a constant, or "
            "renamed by tf2onnx)"
        )
    return None, "no ONNX tensor of its output's shape"


def _plan(graph, calls, values):
    """Per call, the ONNX tensors to compare its output with, and the calls
    with none (and why).

    A Q/DQ tf2onnx renamed (a Transpose moved between its QuantizeLinear
    and DequantizeLinear, a layer quantizing its own input) has no node
    of its scope: it is matched with the activation DequantizeLinears of
    its parent layer that no other Q/DQ took, the best fit chosen.
    """
    plan, unmatched, orphans = [], [], []
    for depth, call in enumerate(calls):
        tensor, why = _match(graph, call, values[call.output].shape)
        if tensor is not None:
            plan.append((depth, call, [tensor]))
        elif _is_qdq(call.layer):
            orphans.append((depth, call, why))
        else:
            unmatched.append((call.name, why))
    taken = {tensors[0] for _, _, tensors in plan}
    for depth, call, why in orphans:
        parent = call.scope.rsplit("/", 1)[0]
        free = [dq for dq in graph.activation_dqs(parent) if dq not in taken]
        if free:
            plan.append((depth, call, free))
        else:
            unmatched.append((call.name, why))
    return sorted(plan, key=lambda p: p[0]), unmatched


def _is_qdq(layer):
    """A calibrated, enabled `QuantizeActivation`: its output is a Q/DQ."""
    return (
        isinstance(layer, QuantizeActivation)
        and layer.enabled
        and _step(layer) > 0
    )


def _step(quantizer):
    """One quantization step of a `QuantizeActivation` (0 uncalibrated)."""
    amax = float(quantizer.amax.numpy())
    return amax / (2 ** (quantizer.num_bits - 1) - 1)


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
    specs = _inputs_mod.input_specs(model, "compare_onnx")
    run, calls, never = _trace(model, specs)
    values = _keras_values(run, inputs)
    graph = _Graph(proto)

    plan, unmatched = _plan(graph, calls, values)
    unmatched = [(path, _NOT_CALLED) for _, path in never] + unmatched
    if not plan:
        raise ValueError(
            f"No layer of model {model.name!r} appears in {onnx_path}: it "
            "is not an export of this model. Export it with "
            "keras_mp.export_onnx(model, path)."
        )
    wanted = [t for _, _, tensors in plan for t in tensors]
    for _, call, _ in plan:
        if call.inputs:
            wanted += graph.activation_dqs(call.scope)
    got = _run(proto, graph, list(dict.fromkeys(wanted)), inputs)

    rows = []
    for depth, call, tensors in plan:
        want = values[call.output]
        found = [
            (err, t)
            for t in tensors
            if (err := _error(got[t], want)) is not None
        ]
        if not found:
            unmatched.append((call.name, f"ONNX tensor {tensors[0]!r} shape"))
            continue
        err, tensor = min(found, key=lambda f: f[0][1])
        layer, steps, qdq = call.layer, None, False
        if call.inputs:
            keras_inputs = [values[i] for i in call.inputs]
            steps = _qdq_steps(layer, graph, call.scope, got, keras_inputs)
        elif _is_qdq(layer):
            qdq = True
            steps = err[0] / _step(layer)
        # A Q/DQ's output is judged in steps only: flips of single values
        # are rounding, however many there are.
        rel_l2 = None if qdq else err[1]
        diverged = _diverged(rel_l2, steps, max_steps, max_rel_l2)
        rows.append(
            LayerError(
                depth, call.name, _kind(layer), tensor, *err, steps, diverged
            )
        )
    return CompareReport(len(inputs[0]), rows, unmatched, max_steps, max_rel_l2)


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

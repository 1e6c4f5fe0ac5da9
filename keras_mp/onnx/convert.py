"""TensorFlow function -> ONNX through tf2onnx, on a frozen graph.

`export_onnx` traces the model, freezes the trace (variables and captured
eager tensors become constants; calls Keras compiles with XLA are made
inlinable) and converts the GraphDef with `tf2onnx.convert.from_graph_def`.
Ops tf2onnx has no converter for go through `OP_HANDLERS`; an op that is
still left raises an `ExportError` naming the Keras layer, and an
optimizer tf2onnx skips after a crash is reported in a warning.
`docs/export.md` ("Real Keras models") has the causes.
"""

import contextlib
import logging
import re
import warnings

import numpy as np

from keras_mp import _keras
from keras_mp._compat import optional_import
from keras_mp._models import walk_layers
from keras_mp.onnx.errors import ExportError
from keras_mp.onnx.graph import walk


def _erfc_as_one_minus_erf(ctx, node, name, args):
    """`Erfc(x)` -> `1 - Erf(x)` (exact GELU lowers to Erfc).

    Exact where it matters: `1 - erf(x)` differs from `erfc(x)` by float32
    rounding of the subtraction only (at most ~6e-8 absolute), and GELU
    multiplies the result by `x / 2`.
    """
    onnx = optional_import("onnx")
    tf2onnx = optional_import("tf2onnx")
    dtype = onnx.helper.tensor_dtype_to_np_dtype(ctx.get_dtype(node.input[0]))
    erf = ctx.make_node("Erf", [node.input[0]])
    one = ctx.make_const(
        tf2onnx.utils.make_name(f"{name}/one"), np.array(1, dtype)
    )
    node.type = "Sub"
    ctx.replace_inputs(node, [one.output[0], erf.output[0]])


# TF op -> handler for ops tf2onnx 1.17 has no converter for. A handler is
# `fn(ctx, node, name, args)` on tf2onnx's graph (its `custom_op_handlers`
# API); each one has its own test in tests/onnx/test_convert.py.
OP_HANDLERS = {
    "Erfc": _erfc_as_one_minus_erf,
}


class _Records(logging.Handler):
    """Keeps the log records tf2onnx emits during one conversion."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@contextlib.contextmanager
def _tf2onnx_log():
    logger = logging.getLogger("tf2onnx")
    handler = _Records()
    logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)


def keras_layers_of(op_name, model):
    """The Keras layer path an op of the traced graph came from.

    TF names an op after the name scopes it was created in, and Keras opens
    one scope per layer call (`functional/conv2d_1/convolution`). The
    scopes are matched level by level against the layers inside the layer
    matched so far, so a namesake elsewhere (every keras-hub block has an
    `ln_1`) is not a candidate. TF adds a `_<n>` suffix when a scope name
    repeats, and the export's trace repeats every one (layer `dense`
    writes `dense_1`, layer `dense_1` writes `dense_1_2`): the name without
    its suffix is tried first, then the segment as it is.

    Args:
        op_name: str. A TF op (or ONNX node) name.
        model: the `keras.Model` that was traced.

    Returns:
        The list of layer names, outermost first (empty when none matches).
    """
    return [layer.name for layer in keras_layer_path(op_name, model)]


def keras_layer_path(op_name, model):
    """`keras_layers_of` as the layer objects themselves."""
    children = {id(model): {}}
    for layer, parents in walk_layers(
        model, include_models=True, with_parents=True
    ):
        parent = parents[-1] if parents else model
        children.setdefault(id(parent), {}).setdefault(layer.name, layer)
    found = []
    candidates = {model.name: model, **children[id(model)]}
    for segment in op_name.split("/")[:-1]:
        base = re.sub(r"_\d+$", "", segment)
        layer = candidates.get(base, candidates.get(segment))
        if layer is not None:
            found.append(layer)
            candidates = children.get(id(layer), {})
    return found


def _unconvertible(proto):
    """Nodes of `proto`, Loop/Scan/If bodies included, that are no ONNX
    operator (tf2onnx left the TF op)."""
    onnx = optional_import("onnx")
    return [
        node
        for node, _, _ in walk(proto.graph)
        if node.domain in ("", "ai.onnx")
        and not onnx.defs.has(node.op_type, "")
    ]


def _raise_unconvertible(nodes, model):
    lines = []
    for node in nodes[:10]:
        layers = keras_layers_of(node.name, model)
        where = f"layer {layers[-1]!r}" if layers else "no Keras layer"
        lines.append(f"{node.op_type} (op {node.name!r}, {where})")
    more = f" and {len(nodes) - 10} more" if len(nodes) > 10 else ""
    ops = sorted({n.op_type for n in nodes})
    raise ExportError(
        f"tf2onnx cannot convert the TensorFlow op(s) {', '.join(ops)} of "
        f"model {model.name!r}: {'; '.join(lines)}{more}. {_advice(ops)} "
        "Nothing was written."
    )


def _advice(ops):
    """What to do about unconvertible `ops`, for their case only."""
    if any(op.startswith("TensorList") for op in ops):
        return (
            "TensorList ops come from a loop lowered to TensorFlow 1 control "
            "flow (a recurrent layer's time loop): tf2onnx converts a "
            "functional While loop, which keras_mp's freeze keeps, but not "
            "this one. Build the layer with `unroll=True` for a short, fixed "
            "sequence length, or write the loop with `keras.ops`."
        )
    gelu = (
        " (for example the tanh approximation, `approximate=True`, for GELU)"
        if {"Erf", "Erfc"} & set(ops)  # what exact GELU lowers to
        else ""
    )
    return (
        f"Replace the layer's computation with ops ONNX has{gelu}, or add a "
        "handler for the op to keras_mp.onnx.convert.OP_HANDLERS."
    )


def _check_stateless(model):
    """Raises for a stateful recurrent layer: ONNX has no variables, so
    the state it carries from one call to the next cannot be exported."""
    keras = optional_import("keras")
    for layer in walk_layers(model):
        if isinstance(layer, keras.layers.RNN) and layer.stateful:
            raise ExportError(
                f"Layer {layer.name!r} of model {model.name!r} is stateful "
                "(stateful=True): it keeps its state in variables between "
                "calls, and an ONNX graph has none, so neither that state "
                "nor the model's fixed batch size can be exported. Export a "
                "copy built with stateful=False and the same weights "
                "(`keras.Model.from_config` of a config with "
                "stateful=False, then `set_weights`): each ONNX run then "
                "starts from a zero state. Nothing was written."
            )


def _warn_failed_optimizers(records, model):
    failed = sorted(
        {
            r.args[0]
            for r in records
            if r.name.startswith("tf2onnx.optimizer")
            and r.msg == "Failed to apply %s"
            and r.args
        }
    )
    if not failed:
        return
    warnings.warn(
        f"tf2onnx's {', '.join(failed)} optimizer(s) crashed on model "
        f"{model.name!r} and were skipped: the ONNX graph is correct but "
        "less optimized than it could be (a skipped transpose optimizer "
        "leaves NHWC<->NCHW Transpose nodes around the convolutions, which "
        "cost time in ONNX Runtime; TensorRT folds most of them).",
        UserWarning,
        stacklevel=4,
    )


def _output_names(serve, inputs, count):
    """The ONNX output names: `serve.output_names` (a dict model's keys, or
    the Keras output layers' names), unique and not an input's name, else
    `output_<k>`."""
    names = list(getattr(serve, "output_names", None) or [])
    if (
        len(names) != count
        or len(set(names)) != count
        or set(names) & set(inputs)
    ):
        names = [f"output_{k}" for k in range(count)]
    return names


def function_to_onnx(serve, model, opset, inputs_as_nchw=None):
    """Converts a traced `tf.function` of `model` to an ONNX ModelProto.

    Args:
        serve: a `tf.function` with an input signature whose specs are
            named after the Keras inputs: the ONNX inputs keep those names
            and dtypes. Its `output_names` attribute, when set, names the
            ONNX outputs.
        model: the `keras.Model` that `serve` calls (named in messages).
        opset: int. The ONNX opset, <= 18 (tf2onnx 1.17's last).
        inputs_as_nchw: list of input names to expose as NCHW, or None.

    Returns:
        The `onnx.ModelProto`.

    Raises:
        ExportError: tf2onnx failed, or left an op ONNX does not have.
    """
    tf2onnx = optional_import("tf2onnx")
    _check_stateless(model)
    concrete = serve.get_concrete_function()
    graph_def, inputs, outputs = _keras.frozen_graph_def(concrete)
    specs = [s.name for s in concrete.structured_input_signature[0]]
    rename = dict(zip(inputs, specs))
    rename.update(zip(outputs, _output_names(serve, specs, len(outputs))))
    by_spec = {spec: tensor for tensor, spec in rename.items()}
    nchw = None
    if inputs_as_nchw:
        nchw = [by_spec.get(n, n) for n in inputs_as_nchw]
    with _tf2onnx_log() as records:
        try:
            proto, _ = tf2onnx.convert.from_graph_def(
                graph_def,
                input_names=inputs,
                output_names=outputs,
                opset=opset,
                inputs_as_nchw=nchw,
                custom_op_handlers={
                    op: (fn, []) for op, fn in OP_HANDLERS.items()
                },
                tensors_to_rename=rename,
            )
        except Exception as e:  # tf2onnx raises bare exceptions
            raise ExportError(
                f"tf2onnx could not convert model {model.name!r} "
                f"({type(e).__name__}: {e}). Nothing was written."
            ) from e
    nodes = _unconvertible(proto)
    if nodes:
        _raise_unconvertible(nodes, model)
    _warn_failed_optimizers(records, model)
    _exact_resize_scales(proto)
    return proto


def _exact_resize_scales(proto):
    """Makes each constant Resize scale give the size TensorFlow asked for.

    tf2onnx turns a resize to a constant size (`nh`, `nw`) of a known input
    size (`h`, `w`) into float32 scales `nh / h`; ONNX (ONNX Runtime,
    TensorRT) sizes the output `floor(h * scale)`, which rounds to one row
    less when the float32 product falls below `nh` (5 * float32(9 / 5) =
    8.99999: keras-hub's DepthAnythingBackbone then adds a 9x9 and an 8x8
    map). The scale is raised by float32 ulps until the product reaches
    `round(h * scale)`; the sampling positions move by ~1e-7 relative.
    """
    onnx = optional_import("onnx")
    numpy_helper = optional_import("onnx.numpy_helper")
    resizes = [n for n, _, _ in walk(proto.graph) if n.op_type == "Resize"]
    scaled = [n for n in resizes if len(n.input) >= 3 and n.input[2]]
    if not scaled:
        return
    inits = {i.name: i for i in proto.graph.initializer}
    try:
        inferred = onnx.shape_inference.infer_shapes(proto).graph
    except Exception:  # shape inference is a nicety here: leave as is
        return
    dims = {
        v.name: [
            d.dim_value if d.HasField("dim_value") else 0
            for d in v.type.tensor_type.shape.dim
        ]
        for v in [*inferred.value_info, *inferred.input]
    }
    for node in scaled:
        shape, init = dims.get(node.input[0]), inits.get(node.input[2])
        if not shape or init is None:
            continue
        scales = numpy_helper.to_array(init).astype(np.float32)
        if scales.shape != (len(shape),):
            continue
        fixed = scales.copy()
        for i, (size, scale) in enumerate(zip(shape, scales)):
            if size <= 0:
                continue
            target = np.round(np.float64(size) * np.float64(scale))
            while np.floor(np.float64(size) * np.float64(fixed[i])) < target:
                fixed[i] = np.nextafter(fixed[i], np.float32(np.inf))
        if not np.array_equal(fixed, scales):
            name = init.name
            init.CopyFrom(numpy_helper.from_array(fixed, name))

"""Export to Q/DQ ONNX (through tf2onnx) and SavedModel, with parity checks.

tf2onnx turns each fake quant into QuantizeLinear/DequantizeLinear with
constant scales. Two things are fixed up after conversion so the graph
meets the TensorRT contract (DESIGN.md): weight Q/DQ pairs on constants are
folded into INT8 initializers, and a Transpose/Reshape that tf2onnx leaves
between a weight's DequantizeLinear and its Conv (depthwise kernels) is
folded into the initializer, so the DQ feeds the Conv directly.
"""

import dataclasses
import os

import numpy as np

from keras_mp._compat import optional_import
from keras_mp.io import atomic_path
from keras_mp.mixed_precision.policy import _check_model
from keras_mp.onnx import fp16 as onnx_fp16
from keras_mp.quantization.layers import (
    QuantizeActivation,
    QuantizeWrapper,
    iter_quantize_layers,
)

# ONNX output-channel axis of each weighted op's weight input.
_WEIGHT_AXIS = {"Conv": 0, "ConvTranspose": 1, "MatMul": -1, "Gemm": None}
_LAYOUT_OPS = ("Transpose", "Reshape", "Identity")
# tf2onnx 1.17 converts up to opset 18; later opsets go through ONNX's
# version converter.
_TF2ONNX_MAX_OPSET = 18


class ExportError(ValueError):
    """The model cannot be exported as asked; the message says why."""


class ParityError(ExportError):
    """ONNX Runtime's outputs differ from Keras' past the tolerance."""


@dataclasses.dataclass
class ParityReport:
    """Keras vs ONNX Runtime on the same inputs."""

    samples: int
    top1_agreement: float
    max_abs_diff: float
    mean_abs_diff: float
    rel_l2: float
    optimized_top1_agreement: float = None
    optimized_rel_l2: float = None

    def __str__(self):
        text = (
            f"ONNX Runtime parity on {self.samples} inputs (graph "
            f"optimizations off): top-1 agreement "
            f"{100 * self.top1_agreement:.2f}%, relative L2 {self.rel_l2:.2e}, "
            f"max |diff| {self.max_abs_diff:.3g}, mean |diff| "
            f"{self.mean_abs_diff:.3g}"
        )
        if self.optimized_top1_agreement is not None:
            text += (
                f"; with ORT's default optimizations: top-1 agreement "
                f"{100 * self.optimized_top1_agreement:.2f}%, relative L2 "
                f"{self.optimized_rel_l2:.2e}"
            )
        return text


def _check_signature(model, what):
    """ExportError unless `model` has known symbolic inputs."""
    _check_model(model)
    try:
        inputs = model.inputs if model.built else None
    except AttributeError:
        raise ExportError(
            f"Model {model.name!r} is a subclassed keras.Model: it has no "
            f"symbolic inputs, so {what} does not know its input signature. "
            "Wrap it in a functional model first: `x = keras.Input(shape); "
            "keras.Model(x, model(x))`."
        ) from None
    if not inputs:
        raise ExportError(
            f"Model {model.name!r} has never been called, so its input "
            "signature is unknown. Build it with `keras.Input(...)` or call it "
            "once on a batch before exporting."
        )


def _check_exportable(model):
    _check_signature(model, "export_onnx")
    problems = []
    for layer in iter_quantize_layers(model):
        quantizers = (
            layer.input_quantizers
            if isinstance(layer, QuantizeWrapper)
            else [layer]
        )
        for q in quantizers:
            if isinstance(q, QuantizeActivation) and not (
                0 < float(q.amax.numpy()) < np.inf
            ):
                problems.append(f"{layer.name}/{q.name}")
    if problems:
        raise ExportError(
            f"Uncalibrated (or collapsed, amax 0) or non-finite activation "
            f"ranges in {', '.join(problems)}: their scale would be 0, NaN "
            "or inf, which TensorRT rejects. Run keras_mp.calibrate(model, "
            "data) first (on finite data), or skip those layers with "
            "QuantizeConfig(skip=True)."
        )


def _input_signature(model):
    import tensorflow as tf

    return [
        tf.TensorSpec(
            (None,) + tuple(t.shape[1:]), tf.float32, name=f"input_{i}"
        )
        for i, t in enumerate(model.inputs)
    ]


def _trace(model):
    import tensorflow as tf

    signature = _input_signature(model)

    @tf.function(input_signature=signature)
    def serve(*inputs):
        out = model(
            list(inputs) if len(inputs) > 1 else inputs[0], training=False
        )
        outs = out if isinstance(out, (list, tuple)) else [out]
        return [tf.cast(o, tf.float32) for o in outs]

    return serve, signature


def _initializers(graph):
    return {init.name: init for init in graph.initializer}


def _fold_weight_qdq(model_proto):
    """Weights: QuantizeLinear(const) -> INT8 initializer, and Transpose /
    Reshape between the DequantizeLinear and its weighted op folded away."""
    onnx = optional_import("onnx")
    from onnx import numpy_helper

    graph = model_proto.graph
    inits = _initializers(graph)
    producer = {out: node for node in graph.node for out in node.output}
    consumers = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    for node in list(graph.node):
        axis = _WEIGHT_AXIS.get(node.op_type, "skip")
        if axis == "skip" or len(node.input) < 2:
            continue
        chain, name = [], node.input[1]
        while name in producer and producer[name].op_type in _LAYOUT_OPS:
            chain.append(producer[name])
            name = producer[name].input[0]
        dq = producer.get(name)
        if dq is None or dq.op_type != "DequantizeLinear":
            continue
        codes, scale, zero, dq_axis = _dq_constants(dq, producer, inits)
        if codes is None or (not chain and dq.input[0] in inits):
            continue
        values = _dequantize(codes, scale, dq_axis)
        for op in reversed(chain):
            values = _apply_layout(op, values, inits)
        weight_axis = axis if axis is not None else 1
        weight_axis %= values.ndim
        if scale.size > 1:
            shape = [1] * values.ndim
            shape[weight_axis] = -1
            if values.shape[weight_axis] != scale.size:
                continue  # not per-channel on the output axis: leave it
            new_codes = np.rint(values / scale.reshape(shape))
        else:
            new_codes = np.rint(values / scale)
        new_codes = new_codes.astype(np.int8)
        base = f"{node.name}_weight"
        graph.initializer.extend(
            [
                numpy_helper.from_array(new_codes, f"{base}_int8"),
                numpy_helper.from_array(
                    scale.astype(np.float32), f"{base}_scale"
                ),
                numpy_helper.from_array(
                    np.zeros(scale.shape, np.int8), f"{base}_zero_point"
                ),
            ]
        )
        attrs = {"axis": weight_axis} if scale.size > 1 else {}
        new_dq = onnx.helper.make_node(
            "DequantizeLinear",
            [f"{base}_int8", f"{base}_scale", f"{base}_zero_point"],
            [f"{base}_dq"],
            name=f"{base}_DequantizeLinear",
            **attrs,
        )
        graph.node.insert(list(graph.node).index(node), new_dq)
        node.input[1] = f"{base}_dq"
    _prune_dead(graph)
    return model_proto


def _dq_constants(dq, producer, inits):
    from onnx import helper, numpy_helper

    def const(name):
        if name in inits:
            return numpy_helper.to_array(inits[name])
        node = producer.get(name)
        if node is not None and node.op_type == "Constant":
            return numpy_helper.to_array(node.attribute[0].t)
        return None

    axis = next(
        (
            helper.get_attribute_value(a)
            for a in dq.attribute
            if a.name == "axis"
        ),
        1,
    )
    scale = const(dq.input[1])
    zero = const(dq.input[2]) if len(dq.input) > 2 else None
    codes = const(dq.input[0])
    q = producer.get(dq.input[0])
    if codes is None and q is not None and q.op_type == "QuantizeLinear":
        values = const(q.input[0])
        if values is None:
            return None, None, None, None
        q_axis = next(
            (
                helper.get_attribute_value(a)
                for a in q.attribute
                if a.name == "axis"
            ),
            1,
        )
        codes = _quantize(values, const(q.input[1]), q_axis)
    if codes is None or scale is None:
        return None, None, None, None
    return codes, np.asarray(scale, np.float32), zero, axis


def _broadcast_scale(scale, ndim, axis):
    if scale.size == 1:
        return scale.reshape(())
    shape = [1] * ndim
    shape[axis % ndim] = -1
    return scale.reshape(shape)


def _quantize(values, scale, axis):
    scale = _broadcast_scale(np.asarray(scale, np.float32), values.ndim, axis)
    return np.clip(np.rint(values / scale), -128, 127).astype(np.int8)


def _dequantize(codes, scale, axis):
    return codes.astype(np.float32) * _broadcast_scale(scale, codes.ndim, axis)


def _apply_layout(op, values, inits):
    from onnx import helper, numpy_helper

    if op.op_type == "Transpose":
        perm = next(
            (
                helper.get_attribute_value(a)
                for a in op.attribute
                if a.name == "perm"
            ),
            None,
        )
        return np.transpose(values, perm)
    if op.op_type == "Reshape":
        shape = numpy_helper.to_array(inits[op.input[1]])
        return values.reshape([int(s) for s in shape])
    return values


def _prune_dead(graph):
    """Removes nodes and initializers nothing consumes any more."""
    outputs = {o.name for o in graph.output}
    while True:
        used = {name for node in graph.node for name in node.input} | outputs
        dead = [n for n in graph.node if not any(o in used for o in n.output)]
        if not dead:
            break
        for node in dead:
            graph.node.remove(node)
    used = {name for node in graph.node for name in node.input}
    for init in list(graph.initializer):
        if init.name not in used:
            graph.initializer.remove(init)


def _session(path, optimized):
    ort = optional_import("onnxruntime")
    options = ort.SessionOptions()
    if not optimized:
        options.graph_optimization_level = (
            ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        )
    return ort.InferenceSession(
        str(path), options, providers=["CPUExecutionProvider"]
    )


def _run(session, inputs, batch_size=512):
    """ONNX Runtime outputs, each concatenated over batches."""
    names = [i.name for i in session.get_inputs()]
    batches = [
        session.run(
            None,
            {name: x[i : i + batch_size] for name, x in zip(names, inputs)},
        )
        for i in range(0, len(inputs[0]), batch_size)
    ]
    return [np.concatenate(outs) for outs in zip(*batches)]


def _verify_inputs(model, data):
    """`data` as a list of float32 arrays, one per model input, checked."""
    specs = list(model.inputs)
    if isinstance(data, dict):
        names = [t.name for t in specs]
        missing = [n for n in names if n not in data]
        if missing:
            raise ExportError(
                f"`verify_data` has keys {sorted(data)}, but model "
                f"{model.name!r} has inputs {names}: give one array per input."
            )
        data = [data[n] for n in names]
    elif not isinstance(data, (list, tuple)):
        data = [data]
    if len(data) != len(specs):
        raise ExportError(
            f"`verify_data` holds {len(data)} array(s), but model "
            f"{model.name!r} has {len(specs)} input(s): pass a list (or a dict "
            "by input name) with one array per input."
        )
    arrays = []
    for spec, x in zip(specs, data):
        x = np.asarray(x, np.float32)
        if x.ndim == 0 or len(x) == 0:
            raise ExportError("`verify_data` is empty: pass some real inputs.")
        expected = tuple(spec.shape[1:])
        if x.shape[1:] != expected:
            raise ExportError(
                f"`verify_data` has shape {x.shape}, but model {model.name!r} "
                f"expects (batch,) + {expected}. Pass inputs shaped like the "
                "model's."
            )
        arrays.append(x)
    if len({len(x) for x in arrays}) > 1:
        raise ExportError(
            "`verify_data` arrays have different batch sizes "
            f"{[len(x) for x in arrays]}: give every input the same number "
            "of samples."
        )
    return arrays


def _compare(want, got):
    """(top-1 agreement, max |diff|, mean |diff|, relative L2), worst over
    the outputs; top-1 on the outputs with a class axis."""
    agree, max_diff, mean_diff, rel = 1.0, 0.0, 0.0, 0.0
    for w, g in zip(want, got):
        diff = np.abs(w - g)
        if w.ndim >= 2 and w.shape[-1] > 1:
            agree = min(agree, float(np.mean(w.argmax(-1) == g.argmax(-1))))
        max_diff = max(max_diff, float(diff.max()))
        mean_diff = max(mean_diff, float(diff.mean()))
        norm = max(float(np.linalg.norm(w)), 1e-12)
        rel = max(rel, float(np.linalg.norm(w - g)) / norm)
    return agree, max_diff, mean_diff, rel


def verify_onnx(
    model, onnx_path, data, min_top1_agreement=0.999, max_rel_l2=0.01
):
    """Runs Keras and ONNX Runtime on `data` and compares them.

    The reference check runs ONNX Runtime with graph optimizations off, so
    it tests Q/DQ semantics rather than ORT's CPU integer kernels (which
    saturate on CPUs without VNNI); the default-optimized figures are
    reported beside it.

    Args:
        model: the Keras model.
        onnx_path: str. The exported file.
        data: NumPy array of inputs; for a model with several inputs, a
            list of arrays in `model.inputs` order or a dict by input name.
        min_top1_agreement: float. Fail below this. Defaults to 0.999.
        max_rel_l2: float. Fail above this relative L2 difference of the
            outputs. Defaults to 0.01.

    Returns:
        `ParityReport`.

    Raises:
        ParityError: past a tolerance.
    """
    return _verify(
        model, onnx_path, data, min_top1_agreement, max_rel_l2, serve=None
    )


def _keras_outputs(model, inputs, serve=None, batch_size=512):
    """The model's float32 outputs on `inputs`: through `serve` (the
    function export_onnx already traced, so no second trace) or
    `model.predict`."""
    if serve is None:
        want = model.predict(
            inputs if len(inputs) > 1 else inputs[0],
            batch_size=batch_size,
            verbose=0,
        )
        want = want if isinstance(want, (list, tuple)) else [want]
        return [np.asarray(w, np.float32) for w in want]
    chunks = [
        serve(*[a[i : i + batch_size] for a in inputs])
        for i in range(0, len(inputs[0]), batch_size)
    ]
    return [
        np.concatenate([np.asarray(c[k], np.float32) for c in chunks])
        for k in range(len(chunks[0]))
    ]


def _verify(model, onnx_path, data, min_top1_agreement, max_rel_l2, serve):
    inputs = _verify_inputs(model, data)
    if not os.path.isfile(onnx_path):
        raise FileNotFoundError(f"ONNX file not found: {onnx_path}")
    want = _keras_outputs(model, inputs, serve)
    got = _run(_session(onnx_path, optimized=False), inputs)
    agree, max_diff, mean_diff, rel = _compare(want, got)
    opt_agree, _, _, opt_rel = _compare(
        want, _run(_session(onnx_path, True), inputs)
    )
    report = ParityReport(
        len(inputs[0]), agree, max_diff, mean_diff, rel, opt_agree, opt_rel
    )
    if agree < min_top1_agreement or rel > max_rel_l2:
        raise ParityError(
            f"{report}. Tolerance: top-1 agreement >= "
            f"{100 * min_top1_agreement:.2f}% and relative L2 <= {max_rel_l2}."
        )
    return report


def export_onnx(
    model,
    path,
    opset=None,
    inputs_as_nchw=None,
    verify_data=None,
    overwrite=False,
    min_top1_agreement=None,
    max_rel_l2=None,
    fp16=False,
):
    """Exports a Keras model to ONNX with TensorRT-style Q/DQ.

    Works for float, mixed-precision (float32 inputs and outputs) and
    quantized models. The file is written to a temporary path, verified
    when `verify_data` is given, then renamed: a failure leaves no partial
    file and any previous file intact.

    Args:
        model: a called `keras.Model`.
        path: str. The `.onnx` file to write.
        opset: int. ONNX opset, >= 13 (per-channel Q/DQ). Defaults to 17,
            or 19 with `fp16=True`.
        inputs_as_nchw: list of input names to expose as NCHW. Defaults to
            None (NHWC, as the Keras model).
        verify_data: NumPy array. When given, compare ONNX Runtime with
            Keras on it (see `verify_onnx`) before the file lands.
        overwrite: bool. Replace an existing file. Defaults to False.
        min_top1_agreement: float. Parity tolerance. Defaults to 0.999, or
            0.99 with `fp16=True`.
        max_rel_l2: float. Parity tolerance. Defaults to 0.01, or 0.05 with
            `fp16=True` (float16 arithmetic and float16 scales move the
            logits by about 1% against the float32 Keras model).
        fp16: bool. Cast everything that is not INT8 to float16 (inputs and
            outputs stay float32) for a strongly typed TensorRT build, Q/DQ
            scales included; needs opset >= 19. Defaults to False.

    Returns:
        `ParityReport` when `verify_data` was given, else None.

    Raises:
        ExportError: not exportable (never called, uncalibrated ranges,
            opset < 13, existing file without `overwrite`, an op tf2onnx
            cannot convert).
        ParityError: ONNX Runtime disagrees with Keras past the tolerance.

    Example:

    >>> keras_mp.export_onnx(qmodel, "model.onnx", verify_data=x_test[:1000])
    """
    tf2onnx = optional_import("tf2onnx")
    onnx = optional_import("onnx")
    if opset is None:
        opset = onnx_fp16.MIN_OPSET if fp16 else 17
    if not isinstance(opset, int) or opset < 13:
        raise ExportError(
            f"Per-channel Q/DQ needs opset >= 13. Received: opset={opset!r}"
        )
    if opset > onnx.defs.onnx_opset_version():
        raise ExportError(
            f"onnx {onnx.__version__} knows opsets up to "
            f"{onnx.defs.onnx_opset_version()}. Received: opset={opset}"
        )
    if fp16 and opset < onnx_fp16.MIN_OPSET:
        raise ExportError(
            "fp16=True stores Q/DQ scales as float16, which needs opset >= "
            f"{onnx_fp16.MIN_OPSET}. Received: opset={opset}. Pass "
            f"opset={onnx_fp16.MIN_OPSET}."
        )
    path = os.fspath(path)
    if os.path.exists(path) and not overwrite:
        raise ExportError(
            f"{path} exists. Pass overwrite=True (CLI: --overwrite) to "
            "replace it."
        )
    _check_exportable(model)
    serve, signature = _trace(model)
    try:
        proto, _ = tf2onnx.convert.from_function(
            serve,
            input_signature=signature,
            opset=min(opset, _TF2ONNX_MAX_OPSET),
            inputs_as_nchw=inputs_as_nchw,
        )
    except Exception as e:  # tf2onnx raises bare exceptions for unknown ops
        raise ExportError(
            f"tf2onnx could not convert model {model.name!r}: {e}"
        ) from e
    if max_rel_l2 is None:
        max_rel_l2 = 0.05 if fp16 else 0.01
    if min_top1_agreement is None:
        min_top1_agreement = 0.99 if fp16 else 0.999
    proto = _fold_weight_qdq(proto)
    proto = onnx_fp16.convert_version(proto, opset)
    if fp16:
        try:
            proto = onnx_fp16.to_float16(proto)
        except ValueError as e:
            raise ExportError(str(e)) from e
    onnx.checker.check_model(proto)
    _warn_if_not_tensorrt_ready(model, proto)
    report = None
    with atomic_path(path) as tmp:
        onnx.save(proto, tmp)
        if verify_data is not None:
            report = _verify(
                model,
                tmp,
                verify_data,
                min_top1_agreement,
                max_rel_l2,
                serve=serve,
            )
    return report


def _warn_if_not_tensorrt_ready(model, proto):
    """A warning when the graph breaks the TensorRT contract, e.g. a model
    quantized by Keras' own `model.quantize("int8")` (MatMulInteger)."""
    import warnings

    from keras_mp.onnx.tensorrt import check_tensorrt

    lint = check_tensorrt(proto, check_sparsity=False)
    if lint.ok:
        return
    rules = sorted({f.rule for f in lint.violations})
    warnings.warn(
        f"The ONNX graph of model {model.name!r} breaks the TensorRT "
        f"explicit-quantization contract ({len(lint.violations)} "
        f"violation(s): {', '.join(rules)}); TensorRT will not build it as "
        "INT8. If the model was quantized with Keras' own "
        "`model.quantize(...)`, quantize the float model with "
        "`keras_mp.quantize_model` instead. Run `keras_mp.check_tensorrt` "
        "on the file for the per-node list.",
        UserWarning,
        stacklevel=3,
    )


def export_saved_model(model, path, overwrite=False, verify_data=None):
    """Exports a serving SavedModel (`serve` endpoint), atomically.

    Quantize wrappers stay (they are the numerics); training-only pieces
    do not reach the graph (`training=False`).

    Args:
        model: a called `keras.Model`.
        path: str. The SavedModel folder.
        overwrite: bool. Replace an existing folder. Defaults to False.
        verify_data: NumPy array. When given, reload and compare outputs.

    Returns:
        The max absolute difference on `verify_data`, or None.
    """
    import tensorflow as tf

    path = os.fspath(path)
    if os.path.exists(path) and not overwrite:
        raise ExportError(f"{path} exists. Pass overwrite=True to replace it.")
    try:
        _check_signature(model, "export_saved_model")
    except ExportError as e:
        if "never been called" in str(e):
            raise ExportError(
                f"Model {model.name!r} has never been called. Call it once "
                "first."
            ) from None
        raise
    diff = None
    with atomic_path(path, is_dir=True) as tmp:
        model.export(tmp, format="tf_saved_model", verbose=False)
        if verify_data is not None:
            loaded = tf.saved_model.load(tmp)
            data = np.asarray(verify_data, np.float32)
            got = loaded.serve(data)
            want = model.predict(data, verbose=0)
            diff = float(np.max(np.abs(np.asarray(got) - want)))
    return diff


def strip_quantization(model):
    """A float copy of a quantized model: wrappers removed, weights kept."""
    from keras_mp.quantization.annotate import (
        QuantizeAnnotate,
        _clone_with_weights,
    )

    _check_model(model)

    def clone(layer):
        if isinstance(layer, (QuantizeWrapper, QuantizeAnnotate)):
            return layer.layer.__class__.from_config(layer.layer.get_config())
        return layer.__class__.from_config(layer.get_config())

    return _clone_with_weights(model, clone)

"""Weight folding: the post-tf2onnx pass that makes each weight an INT8
initializer whose DequantizeLinear feeds its weighted op directly
(`docs/export.md`, "What export fixes up")."""

import numpy as np

from keras_mp._compat import optional_import
from keras_mp.onnx.graph import (
    LAYOUT_OPS,
    GraphIndex,
    apply_layout,
    attr,
    output_channel_axis,
    reads,
)


def _shapes(model_proto, index, op, inferred, known):
    """`index.constants`, plus, for a Reshape whose target shape is computed
    (a Concat of Shape slices that tf2onnx did not fold), that shape: the
    static one ONNX shape inference gives its output, else the shape
    computation evaluated from the weight-side shapes `known` (by tensor
    name). A weight's shape never depends on the batch or the sequence
    length, even where tf2onnx computes it at run time."""
    if op.op_type != "Reshape" or op.input[1] in index.constants:
        return index.constants
    if not inferred:  # once per graph, only when needed
        onnx = optional_import("onnx")
        graph = onnx.shape_inference.infer_shapes(model_proto).graph
        inferred.update(
            (
                info.name,
                [
                    d.dim_value if d.HasField("dim_value") else None
                    for d in info.type.tensor_type.shape.dim
                ],
            )
            for info in list(graph.value_info) + list(graph.output)
        )
    shape = inferred.get(op.output[0])
    if not shape or None in shape:
        shape = _evaluate(index, op.input[1], known)
    if shape is None:
        return index.constants
    return {**index.constants, op.input[1]: np.asarray(shape, np.int64)}


# A shape computation (Shape, Gather, ReduceProd, Concat, ...) is a handful
# of nodes; anything larger is not one.
_MAX_SHAPE_NODES = 32


def _evaluate(index, tensor, known):
    """The value of `tensor` when the nodes computing it read only
    constants (a Shape of a tensor whose shape is `known`, or a weight's
    DequantizeLinear, counts as one), evaluated with ONNX's reference
    evaluator; None otherwise."""
    onnx = optional_import("onnx")
    from onnx.reference import ReferenceEvaluator

    nodes, feeds, pending = {}, {}, [tensor]
    while pending:
        name = pending.pop()
        if not name or name in feeds or name in nodes:
            continue
        node = index.producers.get(name)
        if index.const(name) is not None:
            feeds[name] = index.const(name)
        elif (
            node is not None
            and node.op_type == "Shape"
            and (node.input[0] in known)
        ):
            shape = known[node.input[0]]
            end = attr(node, "end", None)
            feeds[name] = np.asarray(
                shape[attr(node, "start", 0) : end], np.int64
            )
        elif node is not None and node.op_type == "DequantizeLinear":
            codes, scale, axis = _dq_constants(node, index)
            if codes is None:
                return None
            feeds[name] = _dequantize(codes, scale, axis)
        elif node is None or len(nodes) == _MAX_SHAPE_NODES:
            return None
        else:
            nodes[name] = node
            pending.extend(node.input)
    helper = onnx.helper
    chosen = {id(n) for n in nodes.values()}
    graph = helper.make_graph(
        [n for n in index.nodes if id(n) in chosen],  # in graph order
        "shape",
        [
            helper.make_tensor_value_info(
                name,
                helper.np_dtype_to_tensor_dtype(np.asarray(value).dtype),
                np.shape(value),
            )
            for name, value in feeds.items()
        ],
        [helper.make_tensor_value_info(tensor, onnx.TensorProto.INT64, None)],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", index.opset)]
    )
    try:
        (value,) = ReferenceEvaluator(model).run(None, feeds)
    except Exception:  # an op the evaluator does not know: leave it
        return None
    return value


def fold_weight_qdq(model_proto):
    """Folds each weight's Q/DQ and layout ops into INT8 initializers.

    A weight QuantizeLinear on a constant becomes an INT8 initializer, and
    layout ops (Transpose, Reshape, ...) between a weight's
    DequantizeLinear and its Conv, ConvTranspose, MatMul or Gemm are
    applied to the initializer, so the DQ feeds the op directly. The codes
    are those Keras' weight quantizer computed (`_keras_codes`); a
    per-channel weight keeps its scales when the layout ops bring its
    channels onto the op's output-channel axis (an EinsumDense kernel
    `(hidden, heads, head_dim)` flattened to the MatMul weight `(hidden,
    heads * head_dim)`), and is left as it is otherwise. A Reshape
    shape that tf2onnx computes from the weight's own shape at run time
    (EinsumDense kernels with a dynamic sequence length) is evaluated, and
    so is any other Shape of a weight.

    Args:
        model_proto: an `onnx.ModelProto`, edited in place.

    Returns:
        `model_proto`.
    """
    onnx = optional_import("onnx")
    from onnx import numpy_helper

    graph = model_proto.graph
    index = GraphIndex(model_proto)
    inferred = {}
    for node in index.weighted:
        if len(node.input) < 2:
            continue
        source = index.trace(node.input[1])
        dq = source.dq
        if dq is None:
            continue
        codes, scale, dq_axis = _dq_constants(dq, index)
        if codes is None or (
            not source.layout and dq.input[0] in index.constants
        ):
            continue
        values = _dequantize(codes, scale, dq_axis)
        known = {dq.output[0]: values.shape}
        try:
            for op in reversed(source.layout):
                values = apply_layout(
                    op, values, _shapes(model_proto, index, op, inferred, known)
                )
                known[op.output[0]] = values.shape
        except ValueError:  # a shape that is neither constant nor static
            continue
        weight_axis = output_channel_axis(node, 1, values.ndim) % values.ndim
        fmt = _format(dq, index)
        if scale.size > 1:
            if values.shape[weight_axis] != scale.size:
                continue  # not per-channel on the output axis: leave it
            shape = [1] * values.ndim
            shape[weight_axis] = -1
            new_codes = fmt.encode(values / scale.reshape(shape))
            back = new_codes.astype(np.float32) * scale.reshape(shape)
            if not np.array_equal(back, values):
                continue  # channels laid out in another order: leave it
        else:
            new_codes = fmt.encode(values / scale)
        base = f"{node.name}_weight"
        codes_name = f"{base}_{fmt.name}"
        graph.initializer.extend(
            [
                numpy_helper.from_array(new_codes, codes_name),
                numpy_helper.from_array(
                    scale.astype(np.float32), f"{base}_scale"
                ),
                numpy_helper.from_array(
                    np.zeros(scale.shape, fmt.storage), f"{base}_zero_point"
                ),
            ]
        )
        attrs = {"axis": weight_axis} if scale.size > 1 else {}
        new_dq = onnx.helper.make_node(
            "DequantizeLinear",
            [codes_name, f"{base}_scale", f"{base}_zero_point"],
            [f"{base}_dq"],
            name=f"{base}_DequantizeLinear",
            **attrs,
        )
        graph.node.insert(list(graph.node).index(node), new_dq)
        node.input[1] = f"{base}_dq"
    _fold_weight_shapes(graph, index)
    _prune_dead(graph)
    return model_proto


def _fold_weight_shapes(graph, index):
    """Replaces each Shape of a weight (through its Q/DQ and layout ops) by
    its value: tf2onnx computes an EinsumDense output's shape from the
    kernel's at run time with a dynamic sequence length, which would keep
    the unfolded weight Q/DQ in the graph, feeding only that Shape."""
    numpy_helper = optional_import("onnx.numpy_helper")
    for node in index.nodes:
        if node.op_type != "Shape":
            continue
        source = index.trace(node.input[0])
        if source.dq is None or source.name is None:
            continue
        value = _evaluate(index, node.output[0], {})
        if value is None:
            continue
        name = f"{index.name(node)}_value"
        graph.initializer.append(numpy_helper.from_array(value, name))
        for consumer, slot in index.consumers.get(node.output[0], []):
            consumer.input[slot] = name


def _dq_constants(dq, index):
    """(INT8 codes, float32 scale, axis) of a weight DequantizeLinear whose
    codes are a constant or a QuantizeLinear of one, possibly moved by
    layout ops (tf2onnx puts an EinsumDense kernel's Reshape between the Q
    and the DQ); Nones otherwise."""
    scale = index.const(dq.input[1])
    codes = index.const(dq.input[0])
    layout, q = [], index.producers.get(dq.input[0])
    while q is not None and q.op_type in LAYOUT_OPS:
        layout.append(q)
        q = index.producers.get(q.input[0])
    if codes is None and q is not None and q.op_type == "QuantizeLinear":
        values = index.const(q.input[0])
        if values is not None:
            codes = _keras_codes(
                values,
                index.const(q.input[1]),
                attr(q, "axis", 1),
                _format(q, index),
            )
            try:
                for op in reversed(layout):
                    codes = apply_layout(op, codes, index.constants)
            except ValueError:  # a computed shape: leave this weight
                codes = None
    if codes is None or scale is None:
        return None, None, None
    return codes, np.asarray(scale, np.float32), attr(dq, "axis", 1)


def _broadcast_scale(scale, ndim, axis):
    if scale.size == 1:
        return scale.reshape(())
    shape = [1] * ndim
    shape[axis % ndim] = -1
    return scale.reshape(shape)


def _quantize(values, scale, axis):
    """ONNX QuantizeLinear's INT8 codes of `values` (`w / scale`, rounded
    half to even, saturated), for codes that no Keras quantizer computed
    (export's float16 pass requantizing a weight to a raised scale)."""
    scale = _broadcast_scale(np.asarray(scale, np.float32), values.ndim, axis)
    return np.clip(np.rint(values / scale), -128, 127).astype(np.int8)


def _format(qdq, index):
    """The `NumberFormat` row of a Q/DQ, read from its zero point's type
    (int8 without a zero point, ONNX's default)."""
    from keras_mp.quantization.formats import FORMATS, format_of_onnx_type

    dtype = index.dtypes.get(qdq.input[2]) if len(qdq.input) > 2 else None
    return format_of_onnx_type(dtype) if dtype else FORMATS["int8"]


def _keras_codes(values, scale, axis, fmt=None):
    """The codes Keras' weight quantizer gave `values`, bit for bit.

    For int8, TF's `QuantizeAndDequantizeV3` (narrow range, range `amax`
    given) rounds `clip(w, -amax, amax) * float32(127 / amax)` half to
    even, in float32; ONNX's QuantizeLinear rounds `w / scale` with `scale
    = float32(amax / 127)` (all tf2onnx keeps), which picks the other code
    at some ties. So `amax` is recovered from the scale and TF's product is
    rounded. A float format's Keras quantizer computes ONNX's `w / scale`
    itself (`formats._float_qdq`).
    """
    values = np.asarray(values, np.float32)
    scale = _broadcast_scale(np.asarray(scale, np.float32), values.ndim, axis)
    if fmt is not None and fmt.kind != "int":
        return fmt.encode(values / scale)
    amax = _amax(values, scale)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.rint(np.clip(values, -amax, amax) * (np.float32(127) / amax))
    return np.clip(codes, -128, 127).astype(np.int8)


def _amax(values, scale):
    """The float32 range `amax` with `float32(amax / 127) == scale`, per
    channel (`scale` broadcast against `values`).

    keras_mp's weight range is the weight's own `max|w|` (per channel), so
    that is taken when it gives back the scale; otherwise the float32
    nearest `127 * scale` that does. That is the case of a range that is no
    longer the weight's `max|w|` (after `fit`, it is one optimizer step
    old); at most two float32 values give one scale, so only there can the
    pick be the other one, and a code differ at an exact tie.
    """
    channel_axes = tuple(
        a for a in range(values.ndim) if scale.ndim == 0 or scale.shape[a] == 1
    )
    peak = np.max(np.abs(values), axis=channel_axes, keepdims=True)
    near = (scale * np.float32(127)).astype(np.float32)
    amax = near
    for candidate in (
        np.nextafter(near, np.float32(0)),
        np.nextafter(near, np.float32(np.inf)),
        near,
        peak,
    ):  # later candidates win
        amax = np.where(candidate / np.float32(127) == scale, candidate, amax)
    return amax


def _dequantize(codes, scale, axis):
    return codes.astype(np.float32) * _broadcast_scale(scale, codes.ndim, axis)


def _prune_dead(graph):
    """Removes nodes and initializers nothing consumes any more. A tensor
    a Loop/Scan/If body reads from the outer graph counts as used (GRU's
    kernel Transpose, read only inside tf2onnx's Loop)."""
    outputs = {o.name for o in graph.output}
    while True:
        used = {name for node in graph.node for name in reads(node)} | outputs
        dead = [n for n in graph.node if not any(o in used for o in n.output)]
        if not dead:
            break
        for node in dead:
            graph.node.remove(node)
    used = {name for node in graph.node for name in reads(node)}
    for init in list(graph.initializer):
        if init.name not in used:
            graph.initializer.remove(init)

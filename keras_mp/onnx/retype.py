"""Carrier Q/DQ -> the format they stand for (FP8 E4M3 today).

tf2onnx writes Q/DQ only from TensorFlow's `QuantizeAndDequantizeV3`, with
INT8 (or UINT8) zero points, and at opsets up to 18. A `NumberFormat` it
cannot write has a `carrier` (`keras_mp.quantization.formats`): while
`export_onnx` traces the model, such a quantizer computes an unsigned
8-bit Q/DQ of its own scale, which tf2onnx writes with a UINT8 zero point
that no keras_mp quantizer uses otherwise. This pass gives each carrier
its quantizer's exact scale and a zero point of the format's ONNX type
(FLOAT8E4M3FN: TensorRT's parser reads FP8 from it); the weight fold then
stores those weights in that type. `docs/export.md` ("FP8").
"""

import numpy as np

from keras_mp import _record
from keras_mp._compat import optional_import
from keras_mp.onnx.convert import keras_layer_path
from keras_mp.onnx.errors import ExportError
from keras_mp.onnx.graph import (
    FLOAT,
    QDQ_OPS,
    UINT8,
    attr,
    reads,
    subgraphs,
    walk,
)

# How far tf2onnx's float32 carrier scale, `float32(amax * 255 / qmax) /
# 255`, may lie from the quantizer's `amax / qmax` (a few float32 ulps).
_MATCH_RTOL = 1e-5


def carrier_quantizers(model):
    """`(description, format, exported scale, layer name)` of each enabled
    quantizer of `model` whose format the export writes through a
    carrier."""
    from keras_mp.quantization.fake_quant import MIN_AMAX
    from keras_mp.quantization.twins import quantizers

    rows = []
    for q in quantizers(model, "export_onnx"):
        fmt = q.quantizer.format
        if fmt.carrier is None or not (q.quantizer.enabled and q.layer.enabled):
            continue
        amax = np.asarray(q.quantizer.amax.numpy(), np.float32)
        scale = fmt.scale(np.maximum(amax, np.float32(MIN_AMAX)))
        rows.append((q.name, fmt, np.atleast_1d(scale), q.layer.name))
    return rows


def min_opset(model):
    """The lowest opset that holds every format `model`'s quantizers use."""
    return max(
        (row[1].min_opset for row in carrier_quantizers(model)), default=0
    )


def _match(scale, candidates):
    """The candidate (a `carrier_quantizers` row) nearest `scale`, or
    None when none is within `_MATCH_RTOL`."""
    scale = np.atleast_1d(np.asarray(scale, np.float32))
    best, best_err = None, _MATCH_RTOL
    for candidate in candidates:
        if candidate[2].shape != scale.shape:
            continue
        err = float(np.max(np.abs(candidate[2] - scale) / candidate[2]))
        if err <= best_err:
            best, best_err = candidate, err
    return best


def retype_carriers(model_proto, model):
    """Gives every carrier Q/DQ of `model_proto` its format, in place.

    Args:
        model_proto: the `onnx.ModelProto` tf2onnx wrote for `model`, at an
            opset that holds the formats (`min_opset`).
        model: the Keras model traced (its quantizers give the formats and
            exact scales).

    Returns:
        The names of the quantizers whose Q/DQ were retyped.

    Raises:
        ExportError: a carrier Q/DQ matches no quantizer of `model`, or
            its FP8 codes reach an op that cannot take them
            (`_move_qs_to_dqs`).
    """
    onnx = optional_import("onnx")
    numpy_helper = onnx.numpy_helper
    candidates = carrier_quantizers(model)
    inits = {}
    for _node, owner, _ in walk(model_proto.graph):
        for init in owner.initializer:
            inits.setdefault(init.name, init)
    done, retyped, codes, owners = set(), [], {}, {}
    for node, _, _ in walk(model_proto.graph):
        if node.op_type not in QDQ_OPS or len(node.input) < 3:
            continue
        zero = inits.get(node.input[2])
        if zero is None or (
            zero.data_type != UINT8 and node.input[2] not in done
        ):
            continue  # not a carrier (a zero point shared by carriers is
            # retyped at the first)
        scale_init = inits.get(node.input[1])
        match = None
        if scale_init is not None:
            match = _match(numpy_helper.to_array(scale_init), candidates)
        if match is None:
            raise ExportError(
                f"The unsigned 8-bit Q/DQ {node.name!r} of the traced graph "
                "matches no quantizer of an FP8 (carrier) format: keras_mp "
                "writes such Q/DQ only for those. Was the model changed "
                "after calibration, or does it use a TensorFlow "
                "QuantizeAndDequantize op of its own? Nothing was written."
            )
        description, fmt, scale, layer = match
        if node.input[1] not in done:
            shape = tuple(scale_init.dims)
            scale_init.CopyFrom(
                numpy_helper.from_array(scale.reshape(shape), scale_init.name)
            )
            done.add(node.input[1])
        if node.input[2] not in done:
            zeros = np.zeros(tuple(zero.dims), fmt.storage)
            zero.CopyFrom(numpy_helper.from_array(zeros, zero.name))
            done.add(node.input[2])
        if node.op_type == "QuantizeLinear":
            codes[node.output[0]] = onnx.TensorProto.DataType.Value(
                fmt.onnx_type
            )
            owners[node.output[0]] = (description, layer)
        if description not in retyped:
            retyped.append(description)
    _move_qs_to_dqs(model_proto.graph, owners, model)
    graphs = [model_proto.graph] + [
        sub for n, _, _ in walk(model_proto.graph) for sub in subgraphs(n)
    ]
    for graph in graphs:  # the codes' declared type (tf2onnx: UINT8)
        for info in [*graph.value_info, *graph.output]:
            if info.name in codes:
                info.type.tensor_type.elem_type = codes[info.name]
    return retyped


def _move_qs_to_dqs(graph, owners, model):
    """Moves the FP8 QuantizeLinears of `graph` and of its subgraphs
    (`owners` maps their outputs to their quantizers) to the
    DequantizeLinears they feed.

    tf2onnx's optimizer moves a Q back across ops that only move values
    (`_moved_inputs`: Reshape, Transpose, Unsqueeze, Gather, Slice, a
    Concat of Qs of one scale; DLRM's interactions), so those ops take the
    codes. ONNX types FP8 at opset 19 in Q/DQ, Reshape, Identity and Cast
    only (Transpose, Squeeze, Unsqueeze, Flatten from opset 21; Concat,
    Gather, Slice, Split, Tile, Expand at no opset up to 28, onnx 1.23),
    and TensorRT wants each Q next to its DQ. The Qs whose codes meet (at
    a Concat) move as one group: the ops between them and their DQs run on
    the float values, and one Q per DQ reached, of the group's one
    per-tensor scale, quantizes what the op wrote. Rounding and moving
    commute, so no value changes.

    Raises:
        ExportError: codes reach an op that computes with them, or a group
            cannot move (per channel, or a Concat of different scales),
            naming the Keras layer, the op and the quantizer.
    """
    _sort(graph)
    readers = {}
    for node in graph.node:
        for name in reads(node):
            readers.setdefault(name, []).append(node)
    qs = {
        n.output[0]: n
        for n in graph.node
        if n.op_type == "QuantizeLinear" and n.output[0] in owners
    }
    group = {name: name for name in qs}  # union-find over code tensors

    def find(name):
        while group[name] != name:
            group[name] = group[group[name]]
            name = group[name]
        return name

    movers = []
    for node in graph.node:  # topological order: codes flow forwards
        read = [
            node.input[i] for i in _moved_inputs(node) if node.input[i] in group
        ]
        if not read:
            continue
        movers.append(node)
        for name in [*read[1:], *(o for o in node.output if o)]:
            group.setdefault(name, name)
            group[find(name)] = find(read[0])
    members = {}
    for name in group:
        members.setdefault(find(name), set()).add(name)
    floats, removed = set(), set()
    for tensors in members.values():
        roots = [qs[name] for name in sorted(tensors) if name in qs]
        moving = [n for n in movers if n.output[0] in tensors]
        blocked = _blocker(graph, tensors, roots, moving, readers)
        if blocked is not None:
            raise _fp8_error(*blocked, owners[roots[0].output[0]], model)
        if moving:
            floats |= tensors - set(qs)
            removed |= _move(graph, tensors, roots, moving, readers)
    for info in list(graph.value_info):
        if info.name in removed:
            graph.value_info.remove(info)
        elif info.name in floats:
            info.type.tensor_type.elem_type = FLOAT
    _sort(graph)
    for node in graph.node:  # after the sort, which replaces the nodes
        for sub in subgraphs(node):
            _move_qs_to_dqs(sub, owners, model)


# Ops that only move, pick or repeat values, with the input slots holding
# those values: the ops tf2onnx's Q/DQ optimizer moves a Q back across
# (`is_tensor_op`, tf2onnx/optimizer/q_dq_optimizer.py), Concat aside.
_MOVING_OPS = {
    **dict.fromkeys(
        "Identity Reshape Flatten Expand Transpose Squeeze Unsqueeze Slice "
        "Gather GatherND GatherElements Compress Tile ReverseSequence "
        "DepthToSpace Split".split(),
        (0,),
    ),
    **dict.fromkeys(("Scatter", "ScatterND", "ScatterElements"), (0, 2)),
}


def _moved_inputs(node):
    """The input slots of `node` whose values it only moves: every input
    of a Concat; none for other ops, nor for a Scatter that adds or
    multiplies."""
    if node.op_type == "Concat":
        return tuple(range(len(node.input)))
    if attr(node, "reduction", b"none") != b"none":
        return ()
    return _MOVING_OPS.get(node.op_type, ())


def _blocker(graph, tensors, roots, moving, readers):
    """`(node, why)` when the codes `tensors` of Qs `roots` cannot move to
    their DQs across `moving`, else None."""
    for output in graph.output:
        if output.name in tensors:
            return roots[0], f"writes them to the graph output {output.name!r}"
    for name in sorted(tensors):
        for node in readers.get(name, []):
            if (
                node.op_type == "DequantizeLinear"
                and name not in node.input[1:]
            ):
                continue
            moved = {node.input[i] for i in _moved_inputs(node)}
            if name in moved and name not in reads(node) - moved:
                continue  # one of `moving`
            return node, "computes with them (FP8 codes only move)"
    if not moving:
        return None
    for node in moving:
        if any(node.input[i] not in tensors for i in _moved_inputs(node)):
            return node, "joins them with other values"
    why = None
    if any(attr(q, "axis", None) is not None for q in roots):
        why = "moves per-channel codes (keras_mp moves per-tensor Qs only)"
    elif len({tuple(q.input[1:]) for q in roots}) > 1:
        why = "joins codes of different scales"
    return None if why is None else (moving[0], why)


def _move(graph, tensors, roots, moving, readers):
    """Runs `moving` on the float inputs of `roots` and puts one copy of
    `roots[0]` before each DequantizeLinear of `tensors`; returns the
    outputs of the roots removed (no DQ reads them any more)."""
    sources = {q.output[0]: q.input[0] for q in roots}
    for node in moving:
        for i in _moved_inputs(node):
            node.input[i] = sources.get(node.input[i], node.input[i])
    q, count = roots[0], 0
    for name in sorted(tensors - set(sources)):
        for dq in readers.get(name, []):
            if dq.op_type != "DequantizeLinear":
                continue
            moved = graph.node.add()
            moved.CopyFrom(q)
            moved.name = f"{q.name}_moved_{count}"
            moved.output[0] = f"{q.output[0]}_moved_{count}"
            moved.input[0] = name
            dq.input[0] = moved.output[0]
            count += 1
    removed = set()
    for root in roots:
        if not any(
            n.op_type == "DequantizeLinear"
            for n in readers.get(root.output[0], [])
        ):
            graph.node.remove(root)
            removed.add(root.output[0])
    return removed


def _fp8_error(node, why, quantizer, model):
    description, layer = quantizer
    tops = (model, _record.contents(model))  # paths as quantizers name them
    path = [
        layer.name
        for layer in keras_layer_path(node.name, model)
        if all(layer is not top for top in tops)
    ]
    where = (
        f"in Keras layer {'/'.join(path)!r}"
        if path
        else "whose name matches no Keras layer"
    )
    return ExportError(
        f"The FP8 codes of quantizer {description!r} cannot be exported: "
        f"ONNX op {node.op_type} {node.name!r} ({where}) {why}. ONNX types "
        "FP8 tensors at opset 19 in QuantizeLinear/DequantizeLinear, "
        "Reshape, Identity and Cast only, and keras_mp moves an FP8 Q to "
        "its DQs across ops that only move values (Reshape, Transpose, "
        "Concat, Gather, Slice, ...). Quantize layer "
        f"{layer!r} in INT8 (quantize_model(..., config={{{layer!r}: "
        "keras_mp.QuantizeConfig(precision='int8')})) or leave it float, "
        "and report the model. Nothing was written."
    )


def _sort(graph):
    """Orders `graph.node` topologically (stable for nodes already in
    order); outer-scope and initializer names count as available."""
    produced = {o for n in graph.node for o in n.output}
    ready = set()
    pending, ordered = list(graph.node), []
    while pending:
        rest = []
        for node in pending:
            if all(
                i == "" or i not in produced or i in ready for i in node.input
            ):
                ordered.append(node)
                ready.update(node.output)
            else:
                rest.append(node)
        if len(rest) == len(pending):  # a cycle: leave the order as it was
            return
        pending = rest
    copies = [type(n)() for n in ordered]
    for copy, node in zip(copies, ordered):
        copy.CopyFrom(node)
    del graph.node[:]
    graph.node.extend(copies)

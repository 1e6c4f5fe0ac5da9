"""Block-scaled weights in the ONNX graph: INT4, NVFP4, MXFP8, weight-only.

tf2onnx cannot write INT4, FP4 or E8M0 (nor a `block_size` attribute: it
stops at opset 18). While `export_onnx` traces the model
(`formats.onnx_trace`), a block-scaled weight quantizer passes its weight
through unchanged, so the float weight reaches the graph bit for bit, as
the weight of its MatMul/Gemm (possibly through layout ops). This pass
finds each MatMul/Gemm whose weight equals one of the model's block-scaled
weights and gives it what TensorRT reads (onnx-tensorrt's
DequantizeLinear importer; ModelOpt's INT4 AWQ, NVFP4 and MXFP8 ONNX
exports): for INT4 `DequantizeLinear(INT4 codes, float32 scales, axis=K,
block_size=B)` at opset 21, no zero point (symmetric); NVFP4 and MXFP8 as
`_write_dq` says (opsets 23, 24). The codes and scales are those of
`blocks.block_encode`, which repeats the Keras quantizer's rounding; ONNX
packs 4-bit codes two to a byte. `docs/export.md` ("INT4").
"""

import numpy as np

from keras_mp.onnx.errors import ExportError
from keras_mp.onnx.fold import _prune_dead, _shapes
from keras_mp.onnx.graph import GraphIndex, apply_layout, attr


def block_quantizers(model):
    """`(description, quantizer, weight matrix)` of each enabled
    block-scaled weight quantizer of `model`: the weight as its `(K, N)`
    GEMM matrix (`quantizers.matrix_view`)."""
    from keras_mp.quantization.fake_quant import matrix_view
    from keras_mp.quantization.twins import quantizers

    rows = []
    for q in quantizers(model, "export_onnx"):
        tq = q.quantizer
        if not (tq.block_size and tq.enabled and q.layer.enabled):
            continue
        if q.weight is None or q.site:
            continue
        weight = np.asarray(getattr(q.layer, q.weight), np.float32)
        view, _ = matrix_view(weight, tq.block_axes)
        rows.append((q.name, tq, view.numpy()))
    return rows


def min_opset(model):
    """The lowest opset holding `model`'s block-scaled weights (0: none)."""
    return max(
        (
            q.format.block_format.min_opset
            for _, q, _ in block_quantizers(model)
        ),
        default=0,
    )


def write_blocked_weights(model_proto, model):
    """Gives each MatMul/Gemm of `model_proto` (traced under `onnx_trace`,
    at an opset that holds the format) whose float weight is that of a
    block-scaled weight quantizer of `model` its blocked DequantizeLinear,
    in place.

    A weight is recognized by its values once the layout ops tf2onnx put
    before the op (an EinsumDense kernel's Reshape/Transpose, Gemm's
    transB) are applied; the DQ then feeds the op directly, and the float
    weight, with any Shape of it, leaves the graph. Equal weights (a
    keras-hub model's key and value projections built alike; tf2onnx
    merges their initializers) give equal codes.

    Returns:
        The descriptions of the quantizers written.

    Raises:
        ExportError: a block-scaled weight reaches no MatMul/Gemm of the
            graph in a layout keras_mp can read, naming the quantizer.
    """
    from keras_mp.quantization.fake_quant import block_scale

    graph = model_proto.graph
    index = GraphIndex(model_proto)
    rows = [
        (d, q, m, block_scale(q.amax, q.format).numpy())
        for d, q, m in block_quantizers(model)
    ]
    written, dqs, inferred = {}, {}, {}
    for op in index.weighted:
        if op.op_type not in ("MatMul", "Gemm") or len(op.input) < 2:
            continue
        weight = _effective_weight(model_proto, index, op, inferred)
        if weight is None:
            continue
        transposed = op.op_type == "Gemm" and attr(op, "transB", 0)
        matrix = weight.T if transposed else weight
        match = next((r for r in rows if np.array_equal(r[2], matrix)), None)
        if match is None:
            continue
        description, q, matrix, scale = match
        key = (description, bool(transposed))
        if key not in dqs:
            dqs[key] = _write_dq(graph, op, q, matrix, scale, transposed)
        op.input[1] = dqs[key]
        written[description] = True
    missing = [d for d, *_ in rows if d not in written]
    missing = [  # equal to a written one: the same codes
        d
        for d, _, m, s in rows
        if d in missing
        and not any(
            w in written and np.array_equal(m, m2) and np.array_equal(s, s2)
            for w, _, m2, s2 in rows
        )
    ]
    if missing:
        raise ExportError(
            f"The block-scaled weight of quantizer {missing[0]!r} reaches "
            "no MatMul/Gemm of the traced graph as a weight keras_mp can "
            "read (a constant moved by layout ops only): keras_mp writes "
            "INT4 weights for Dense and EinsumDense kernels that tf2onnx "
            "turns into MatMul/Gemm weights. Quantize this layer in INT8 "
            "(QuantizeConfig(precision='int8')) and report the model. "
            "Nothing was written."
        )
    _fold_constant_shapes(graph, index)
    _prune_dead(graph)
    return [d for d, *_ in rows if d not in missing]


def _write_dq(graph, op, q, matrix, scale, transposed):
    """Adds the initializers and DequantizeLinear(s) of `q`'s weight
    `matrix` before `op`; returns the name of the weight they give.

    INT4: `DQ(INT4 codes, float32 scales)`; NVFP4: `DQ(FLOAT4E2M1 codes,
    DQ(FP8 E4M3 block scales, float32 global scale))`; MXFP8:
    `DQ(FLOAT8E4M3FN codes, FLOAT8E8M0 scales)` to float32. Blocked along
    K: axis 0 of a MatMul weight, 1 of a Gemm weight with transB."""
    from onnx import TensorProto, helper, numpy_helper

    from keras_mp.quantization.blocks import block_encode

    fmt = q.format.block_format
    given = scale if fmt.scale_onnx_type == "FLOAT" else None
    codes = block_encode(matrix, fmt, q.block_size, scale=given)
    values, scales, axis = codes.codes, codes.scale, 0
    if transposed:
        values, scales, axis = values.T, scales.T, 1
    base = f"{op.name}_weight"
    graph.initializer.extend(
        [
            numpy_helper.from_array(
                np.ascontiguousarray(values), f"{base}_{fmt.name}"
            ),
            numpy_helper.from_array(
                np.ascontiguousarray(scales), f"{base}_block_scale"
            ),
        ]
    )
    at = list(graph.node).index(op)
    scale_name = f"{base}_block_scale"
    if codes.global_scale is not None:  # NVFP4: FP8 scales times a float32
        graph.initializer.append(
            numpy_helper.from_array(
                np.asarray(codes.global_scale, np.float32),
                f"{base}_global_scale",
            )
        )
        graph.node.insert(
            at,
            helper.make_node(
                "DequantizeLinear",
                [scale_name, f"{base}_global_scale"],
                [f"{base}_scale"],
                name=f"{base}_scale_DequantizeLinear",
            ),
        )
        scale_name, at = f"{base}_scale", at + 1
    extra = {}
    if fmt.scale_onnx_type not in ("FLOAT", "FLOAT8E4M3FN"):
        extra["output_dtype"] = TensorProto.FLOAT  # from E8M0 scales
    graph.node.insert(
        at,
        helper.make_node(
            "DequantizeLinear",
            [f"{base}_{fmt.name}", scale_name],
            [f"{base}_dq"],
            name=f"{base}_DequantizeLinear",
            axis=axis,
            block_size=q.block_size,
            **extra,
        ),
    )
    return f"{base}_dq"


def _effective_weight(model_proto, index, op, inferred):
    """The float weight (input B) of MatMul/Gemm `op` as the op reads it:
    its constant with the layout ops before the op applied; None for a
    computed or quantized input, or a 2-D weight it cannot evaluate."""
    source = index.trace(op.input[1])
    if source.dq is not None or source.name is None:
        return None
    values = np.asarray(source.array)
    if values.dtype != np.float32:
        return None
    known = {source.name: values.shape}
    try:
        for layout in reversed(source.layout):
            values = apply_layout(
                layout,
                values,
                _shapes(model_proto, index, layout, inferred, known),
            )
            known[layout.output[0]] = values.shape
    except ValueError:
        return None
    return values if values.ndim == 2 else None


def _fold_constant_shapes(graph, index):
    """Replaces each Shape of a constant by its value, so a float weight
    read only by Shape (tf2onnx's EinsumDense output shape) leaves the
    graph with the rest of it."""
    from onnx import numpy_helper

    for node in index.nodes:
        if node.op_type != "Shape" or node.input[0] not in index.constants:
            continue
        shape = index.constants[node.input[0]].shape
        end = attr(node, "end", None)
        value = np.asarray(shape[attr(node, "start", 0) : end], np.int64)
        name = f"{index.name(node)}_value"
        graph.initializer.append(numpy_helper.from_array(value, name))
        for consumer, slot in index.consumers.get(node.output[0], []):
            consumer.input[slot] = name

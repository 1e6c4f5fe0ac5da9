"""Block-scaled weights in the ONNX graph: INT4 weight-only today.

tf2onnx cannot write INT4 (nor a `block_size` attribute: it stops at opset
18). While `export_onnx` traces the model (`formats.onnx_trace`), a
block-scaled weight quantizer passes its weight through unchanged, so the
float weight reaches the graph as the initializer of its MatMul/Gemm, with
its values bit for bit. This pass finds each such initializer by those
values, and replaces it with what TensorRT reads (onnx-tensorrt's
DequantizeLinear importer; ModelOpt's INT4 AWQ export):
`DequantizeLinear(INT4 codes, float32 scales, axis=K, block_size=B)`,
opset 21, no zero point (symmetric), the codes and scales those of
`blocks.block_encode`, which repeats the Keras quantizer's rounding. ONNX
packs the INT4 codes two to a byte. `docs/export.md` ("INT4").
"""

import numpy as np

from keras_mp._compat import optional_import
from keras_mp.onnx.errors import ExportError


def block_quantizers(model):
    """`(description, quantizer, weight matrix)` of each enabled
    block-scaled weight quantizer of `model`: the weight as its `(K, N)`
    GEMM matrix (`quantizer.matrix_view`)."""
    from keras_mp.quantization.quantizer import matrix_view
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
    """Replaces the float initializer of each block-scaled weight of
    `model` in `model_proto` (traced under `onnx_trace`, at an opset that
    holds the format) with its blocked DequantizeLinear, in place.

    Returns:
        The descriptions of the quantizers written.

    Raises:
        ExportError: a block-scaled weight has no initializer of its
            values in the graph (e.g. tf2onnx kept an Einsum with the
            weight in another layout), naming the quantizer.
    """
    onnx = optional_import("onnx")
    from onnx import helper, numpy_helper

    from keras_mp.quantization.blocks import block_encode
    from keras_mp.quantization.quantizers import block_scale

    graph = model_proto.graph
    by_shape = {}
    for init in graph.initializer:
        if init.data_type == onnx.TensorProto.FLOAT and len(init.dims) == 2:
            by_shape.setdefault(tuple(init.dims), []).append(init)
    written, nodes = [], []
    for description, q, matrix in block_quantizers(model):
        found = _find(by_shape, matrix, numpy_helper)
        if found is None:
            raise ExportError(
                f"The block-scaled weight of quantizer {description!r} is "
                "not a MatMul/Gemm weight initializer of the traced graph "
                f"(as a {matrix.shape} matrix or its transpose): keras_mp "
                "writes INT4 weights for Dense and EinsumDense kernels that "
                "tf2onnx turns into MatMul/Gemm weights. Quantize this layer "
                "in INT8 (QuantizeConfig(precision='int8')) and report the "
                "model. Nothing was written."
            )
        init, transposed = found
        codes = block_encode(
            matrix,
            q.format.block_format,
            q.block_size,
            axis=0,
            scale=block_scale(q.amax, q.format),
        )
        values, scales, axis = codes.codes, codes.scale, 0
        if transposed:
            values, scales, axis = values.T, scales.T, 1
        name = init.name
        init.CopyFrom(
            numpy_helper.from_array(np.ascontiguousarray(values), name + "_q")
        )
        graph.initializer.append(
            numpy_helper.from_array(
                np.ascontiguousarray(scales, np.float32), name + "_scale"
            )
        )
        nodes.append(
            helper.make_node(
                "DequantizeLinear",
                [name + "_q", name + "_scale"],
                [name],
                name=name + "_dq",
                axis=axis,
                block_size=q.block_size,
            )
        )
        by_shape[tuple(init.dims)] = [
            i for i in by_shape.get(tuple(init.dims), []) if i is not init
        ]
        written.append(description)
    for info in list(graph.input):  # IR < 4 lists initializers as inputs
        if info.name in {n.output[0] for n in nodes}:
            graph.input.remove(info)
    rest = list(graph.node)  # the DQs read initializers only: put first
    del graph.node[:]
    graph.node.extend(nodes + rest)
    return written


def _find(by_shape, matrix, numpy_helper):
    """`(initializer, transposed)` holding `matrix`'s values (as they are,
    or transposed for a Gemm with transB), or None."""
    for candidate, transposed in ((matrix, False), (matrix.T, True)):
        for init in by_shape.get(candidate.shape, []):
            if np.array_equal(numpy_helper.to_array(init), candidate):
                return init, transposed
    return None

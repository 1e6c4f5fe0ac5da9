"""Float16 ONNX for strongly typed TensorRT builds (`export_onnx(fp16=True)`):
every float32 tensor inside the graph, Q/DQ scales included, becomes
float16; inputs and outputs stay float32 (`docs/export.md`, "Float16
graphs for strongly typed TensorRT")."""

import numpy as np

from keras_mp._compat import optional_import

# Float inputs that ONNX requires to stay float32 whatever the data type:
# (op_type, input index).
_KEEP_FLOAT32_INPUTS = {("Resize", 2), ("Upsample", 1)}
# Smallest float16 normal number: a scale below it loses precision.
_FP16_TINY = float(np.finfo(np.float16).tiny)
_FP16_MAX = float(np.finfo(np.float16).max)
MIN_OPSET = 19


def convert_version(model_proto, opset):
    """`model_proto` moved to the default-domain `opset` (no-op if equal)."""
    optional_import("onnx")
    current = next(
        o.version
        for o in model_proto.opset_import
        if o.domain in ("", "ai.onnx")
    )
    if current == opset:
        return model_proto
    from onnx import version_converter

    return version_converter.convert_version(model_proto, opset)


def to_float16(model_proto):
    """Float32 -> float16 inside the graph; inputs and outputs stay float32.

    Args:
        model_proto: an `onnx.ModelProto` at opset >= 19.

    Returns:
        The converted `onnx.ModelProto` (a new object).

    Raises:
        ValueError: a constant is outside float16's range, or a Q/DQ scale
            is below float16's smallest normal number (it would lose its
            precision): export in float32 instead.
    """
    onnx = optional_import("onnx")
    from onnx import helper, numpy_helper

    FLOAT, FLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    model = onnx.ModelProto()
    model.CopyFrom(model_proto)
    graph = model.graph
    keep32 = set()
    for node in graph.node:
        for op_type, slot in _KEEP_FLOAT32_INPUTS:
            if node.op_type == op_type and len(node.input) > slot:
                keep32.add(node.input[slot])
    scales = {
        node.input[1]
        for node in graph.node
        if node.op_type in ("QuantizeLinear", "DequantizeLinear")
    }

    def half(array, name):
        finite = array[np.isfinite(array)]
        if finite.size and np.max(np.abs(finite)) > _FP16_MAX:
            raise ValueError(
                f"Constant '{name}' holds {np.max(np.abs(finite)):.3g}, "
                f"beyond float16's largest value {_FP16_MAX:g}: this model "
                "cannot run in float16. Export with fp16=False."
            )
        if name in scales and np.any(array < _FP16_TINY):
            raise ValueError(
                f"Quantization scale '{name}' has values down to "
                f"{np.min(array):.3g}, below float16's smallest normal "
                f"number {_FP16_TINY:.3g}: the float16 scale would lose "
                "its precision. Recalibrate, skip that layer, or export "
                "with fp16=False."
            )
        return array.astype(np.float16)

    for init in graph.initializer:
        if init.data_type == FLOAT and init.name not in keep32:
            init.CopyFrom(
                numpy_helper.from_array(
                    half(numpy_helper.to_array(init), init.name), init.name
                )
            )
    for node in graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if (
                    attr.name == "value"
                    and attr.t.data_type == FLOAT
                    and node.output[0] not in keep32
                ):
                    attr.t.CopyFrom(
                        numpy_helper.from_array(
                            half(numpy_helper.to_array(attr.t), node.output[0]),
                            attr.t.name,
                        )
                    )
        for attr in node.attribute:
            if node.op_type == "Cast" and attr.name == "to" and attr.i == FLOAT:
                attr.i = FLOAT16
            if node.op_type == "ConstantOfShape" and attr.name == "value":
                if attr.t.data_type == FLOAT:
                    attr.t.CopyFrom(
                        numpy_helper.from_array(
                            numpy_helper.to_array(attr.t).astype(np.float16)
                        )
                    )

    # Boundaries: float32 in, Cast to float16; float16 out, Cast to float32.
    casts = []
    for value in graph.input:
        if value.type.tensor_type.elem_type != FLOAT:
            continue
        inner = f"{value.name}_fp16"
        for node in graph.node:
            for i, name in enumerate(node.input):
                if name == value.name:
                    node.input[i] = inner
        casts.append(
            helper.make_node(
                "Cast", [value.name], [inner], name=f"{inner}_Cast", to=FLOAT16
            )
        )
    for node in reversed(casts):
        graph.node.insert(0, node)
    for value in graph.output:
        if value.type.tensor_type.elem_type != FLOAT:
            continue
        inner = f"{value.name}_fp16"
        for node in graph.node:
            for i, name in enumerate(node.output):
                if name == value.name:
                    node.output[i] = inner
            for i, name in enumerate(node.input):
                if name == value.name:
                    node.input[i] = inner
        graph.node.append(
            helper.make_node(
                "Cast",
                [inner],
                [value.name],
                name=f"{value.name}_Cast",
                to=FLOAT,
            )
        )
    # Intermediate types changed: let shape inference recompute them.
    del graph.value_info[:]
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)

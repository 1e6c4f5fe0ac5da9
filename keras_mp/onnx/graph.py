"""One indexed view of an ONNX graph, and the per-op facts export and lint
share: which inputs hold a weight, its output- and input-channel axes, and
which ops only move values (`docs/tensorrt.md`)."""

import dataclasses

import numpy as np

from keras_mp._compat import optional_import
from keras_mp.quantization import formats
from keras_mp.quantization.placement import LAYOUT_OPS

# ONNX element types (onnx.TensorProto values, fixed by the ONNX spec);
# spelled out so this module imports without onnx installed.
FLOAT, UINT8, INT8, INT32, INT64 = 1, 2, 3, 6, 7
FLOAT8E4M3FN = 17
ELEMENT_TYPES = {
    "FLOAT": FLOAT,
    "UINT8": UINT8,
    "INT8": INT8,
    "INT32": INT32,
    "INT64": INT64,
    "FLOAT8E4M3FN": FLOAT8E4M3FN,
}
# The Q/DQ element types TensorRT builds: the `onnx_type` of the
# `keras_mp.quantization.FORMATS` rows it runs (`formats.TENSORRT_QDQ_TYPES`).
TENSORRT_QDQ_TYPES = frozenset(
    ELEMENT_TYPES[name] for name in formats.TENSORRT_QDQ_TYPES
)

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
# Input slots holding a weight, and the bias slot, of each weighted op.
WEIGHT_SLOTS = {
    "Conv": (1,),
    "ConvTranspose": (1,),
    "MatMul": (0, 1),
    "Gemm": (0, 1),
}
BIAS_SLOT = 2
# `LAYOUT_OPS` (imported above, written in `placement.py` beside the other
# ops that only move values): ops that may stand between a weight and its
# op in a float graph, but not between a weight's DQ and its op.
# Ops whose matmuls run inside the op: TensorRT's ONNX importer builds
# them from float inputs only, so they stay float (`docs/export.md`,
# "Recurrent layers").
RECURRENT_OPS = frozenset({"LSTM", "GRU", "RNN"})


def subgraphs(node):
    """The subgraphs (bodies, branches) held by `node`'s attributes: a
    Loop's or Scan's body, an If's two branches."""
    for attribute in node.attribute:
        if attribute.HasField("g"):
            yield attribute.g
        yield from attribute.graphs


def outer_names(body):
    """The tensor names `body` (and the subgraphs inside it) reads from
    the scopes around it: ONNX lets a body use any outer tensor by name,
    without listing it as an input of the node that holds the body."""
    own = {v.name for v in body.input} | {i.name for i in body.initializer}
    read = set()
    for node in body.node:
        own.update(node.output)
        read.update(name for name in node.input if name)
        for sub in subgraphs(node):
            read |= outer_names(sub)
    return read - own


def reads(node):
    """Every tensor `node` reads: its inputs, and for a node holding
    subgraphs, the outer names they read (`outer_names`)."""
    names = {name for name in node.input if name}
    for sub in subgraphs(node):
        names |= outer_names(sub)
    return names


def walk(graph, path=()):
    """Every node of `graph` and of the subgraphs inside it, depth first.

    Yields:
        `(node, owner, path)`: the node, the `GraphProto` that holds it
        and the nodes holding that graph, outermost first (empty for a
        top-level node).
    """
    for node in graph.node:
        yield node, graph, path
        for sub in subgraphs(node):
            yield from walk(sub, (*path, node))


def attr(node, name, default):
    """The value of attribute `name` of `node`, or `default`."""
    for attribute in node.attribute:
        if attribute.name == name:
            helper = optional_import("onnx.helper")
            return helper.get_attribute_value(attribute)
    return default


def constant_value(node):
    """The value of a Constant node and its ONNX element type, or None."""
    for attribute in node.attribute:
        value = optional_import("onnx.helper").get_attribute_value(attribute)
        if attribute.name == "value":
            array = optional_import("onnx.numpy_helper").to_array(value)
            return array, value.data_type
        if attribute.name.startswith("value_float"):
            return np.asarray(value, np.float32), FLOAT
        if attribute.name.startswith("value_int"):
            return np.asarray(value, np.int64), INT64
    return None


def output_channel_axis(op, slot, rank):
    """The output-channel axis of input `slot` of weighted op `op`."""
    if op.op_type == "Conv":
        return 0
    if op.op_type == "ConvTranspose":
        return 1
    if op.op_type == "Gemm":
        transposed = attr(op, "transB" if slot == 1 else "transA", 0)
        return int(bool(transposed) != (slot == 1))
    return rank - 1 if slot == 1 else rank - 2


def input_channel_axis(op_type, rank, trans_b=False):
    """The input-channel axis of the weight (slot 1) of an `op_type`."""
    if op_type == "Conv":
        return 1
    if op_type == "ConvTranspose":
        return 0  # (C_in, C_out / group, kH, kW)
    if op_type == "Gemm":
        return 1 if trans_b else 0
    return rank - 2


@dataclasses.dataclass
class Source:
    """Where a weighted op's input comes from, walking backwards."""

    layout: list  # layout nodes between the op and the DQ (or constant)
    dq: object = None
    q: object = None
    name: str = None  # the constant at the root, if there is one
    array: np.ndarray = None


class GraphIndex:
    """Producers, consumers, constants and element types of an ONNX graph,
    and where each weighted op's weights come from.

    Args:
        model: an `onnx.ModelProto`. Indexed once; a pass that edits the
            graph builds a new index afterwards.
    """

    def __init__(self, model):
        onnx = optional_import("onnx")
        graph = model.graph
        self.opset = max(
            (
                o.version
                for o in model.opset_import
                if o.domain in ("", "ai.onnx")
            ),
            default=0,
        )
        self.nodes = list(graph.node)
        self._names = {
            id(n): n.name or f"{n.op_type}_{i}"
            for i, n in enumerate(self.nodes)
        }
        self.constants, self.dtypes = {}, {}
        try:  # Element types of run-time tensors; index graphs it cannot type.
            typed = onnx.shape_inference.infer_shapes(model).graph
        except Exception:
            typed = graph
        for info in [*typed.value_info, *typed.input, *typed.output]:
            self.dtypes[info.name] = info.type.tensor_type.elem_type
        for init in graph.initializer:
            self.constants[init.name] = onnx.numpy_helper.to_array(init)
            self.dtypes[init.name] = init.data_type
        self.producers, self.consumers = {}, {}
        for node in self.nodes:
            for i, name in enumerate(node.input):
                self.consumers.setdefault(name, []).append((node, i))
            for name in node.output:
                self.producers[name] = node
            if node.op_type == "Constant" and (value := constant_value(node)):
                self.constants[node.output[0]] = value[0]
                self.dtypes[node.output[0]] = value[1]
        self.qdq = [n for n in self.nodes if n.op_type in QDQ_OPS]
        # Ops whose weights TensorRT runs in float whatever the graph says:
        # recurrent ops, and weighted ops inside Loop/Scan/If bodies (the
        # Q/DQ rules below look at the top-level graph only).
        self.float_weighted = [
            (node, path)
            for node, _, path in walk(graph)
            if node.op_type in RECURRENT_OPS
            or (path and node.op_type in WEIGHT_SLOTS)
        ]
        for node, path in self.float_weighted:
            if path:
                self._names[id(node)] = "/".join(
                    p.name or p.op_type for p in (*path, node)
                )
            else:
                self._names.setdefault(id(node), node.name or node.op_type)
        self.weighted = [n for n in self.nodes if n.op_type in WEIGHT_SLOTS]
        self.weights, self.weight_use = [], {}
        for op in self.weighted:
            for i in (*WEIGHT_SLOTS[op.op_type], BIAS_SLOT):
                source = self.trace(op.input[i]) if i < len(op.input) else None
                if source is None or source.name is None:
                    continue
                if i != BIAS_SLOT:
                    self.weights.append((op, i, source))
                for qdq in (source.dq, source.q):
                    if qdq is not None:
                        self.weight_use[id(qdq)] = (op, i, source)

    def name(self, node):
        """The node's name, or `<op_type>_<index>` for an unnamed node."""
        return self._names.get(id(node)) or node.name or node.op_type

    def const(self, tensor):
        """The value of a constant tensor (through Identity), else None."""
        node = self.producers.get(tensor)
        while node is not None and node.op_type == "Identity":
            tensor, node = node.input[0], self.producers.get(node.input[0])
        return self.constants.get(tensor)

    def trace(self, tensor):
        """Walks back from an op input through layout ops and a Q/DQ pair.

        Returns:
            A `Source`: the layout ops before the DequantizeLinear, the DQ
            and Q nodes, and the constant at the root (its name is None
            when the input is computed at run time).
        """
        source = Source(layout=[])
        while tensor not in self.constants:
            node = self.producers.get(tensor)
            if node is None:
                return source
            if node.op_type == "DequantizeLinear" and source.dq is None:
                source.dq = node
            elif node.op_type == "QuantizeLinear" and source.q is None:
                if source.dq is None:
                    return source
                source.q = node
            elif node.op_type in LAYOUT_OPS:
                if source.dq is None:
                    source.layout.append(node)
            elif not (node.op_type == "Cast" and self._after_dq(node, source)):
                return source
            tensor = node.input[0]
        source.name, source.array = tensor, self.constants[tensor]
        return source

    def _after_dq(self, cast, source):
        """Whether `cast` is the Cast of a DequantizeLinear's values to the
        GEMM's type (NVFP4's float32 "DQ -> DQ -> Cast(f16) -> MatMul")."""
        producer = self.producers.get(cast.input[0])
        return (
            source.dq is None
            and producer is not None
            and producer.op_type == "DequantizeLinear"
        )

    def quantized_inputs(self, op):
        """For the first two inputs of `op`: whether a DQ produces it."""
        return [self.trace(t).dq is not None for t in op.input[:2]]


def apply_layout(op, values, constants):
    """`values` moved by layout op `op` (one of `LAYOUT_OPS`), as NumPy.

    Args:
        op: the ONNX node.
        values: NumPy array. Its data input.
        constants: dict of constant tensors by name (shapes, axes).

    Raises:
        ValueError: a Reshape whose target shape is not a constant.
    """
    if op.op_type == "Transpose":
        return np.transpose(values, attr(op, "perm", None))
    if op.op_type == "Reshape":
        if op.input[1] not in constants:
            raise ValueError(f"Reshape '{op.name}' has a computed shape")
        shape = [int(s) for s in constants[op.input[1]]]
        shape = [values.shape[i] if s == 0 else s for i, s in enumerate(shape)]
        return values.reshape(shape)
    if op.op_type == "Flatten":
        axis = attr(op, "axis", 1) % max(values.ndim, 1)
        return values.reshape(int(np.prod(values.shape[:axis])), -1)
    if op.op_type in ("Squeeze", "Unsqueeze"):
        axes = attr(op, "axes", None)
        if axes is None and len(op.input) > 1 and op.input[1]:
            axes = [int(a) for a in constants[op.input[1]]]
        if op.op_type == "Squeeze":
            return np.squeeze(values, None if axes is None else tuple(axes))
        return np.expand_dims(values, tuple(axes))
    return values

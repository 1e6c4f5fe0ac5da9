"""Which nodes of a strongly typed export stay float32, and why.

`find_islands` reads the float32 ONNX graph and the Keras model and names
the nodes `fp16.to_half` must leave in float32: the layers the Keras
policy computes in float32, values measured beyond a magnitude threshold,
inputs ONNX requires in float32, and the Q/DQ pairs and weighted ops tied
to those. `docs/export.md` ("Strongly typed graphs") explains each reason
and compares the rules with NVIDIA ModelOpt's AutoCast.
"""

import dataclasses
import json
import warnings

import numpy as np

from keras_mp import _keras, layer_table
from keras_mp._compat import optional_import
from keras_mp._models import walk_layers
from keras_mp.onnx.convert import keras_layer_path
from keras_mp.onnx.fp16 import KEEP_FLOAT32_INPUTS
from keras_mp.onnx.graph import (
    FLOAT,
    LAYOUT_OPS,
    QDQ_OPS,
    WEIGHT_SLOTS,
    reads,
)

# AutoCast's default `data_max`: a node whose inputs or outputs exceed it
# stays float32 (float16 keeps 1/4 absolute precision at 512, and a square
# or a sum of such values passes 65504).
MAX_MAGNITUDE = 512.0
_FP16_MAX = float(np.finfo(np.float16).max)
# The key of the JSON list of float32 nodes in the ONNX file's metadata.
METADATA_KEY = "keras_mp.float32_nodes"
REASONS = {
    "policy": "the Keras layer computes in float32",
    "magnitude": "values measured beyond the threshold",
    "onnx": "ONNX requires float32 here",
    "qdq": "Q/DQ pair or weighted op tied to a float32 node",
    "layout": "moves a float32 node's values",
}
# The TensorRT lint (`rules.py`) takes float32 Q/DQ scales, or float16 at
# opset >= 19; a bfloat16 graph keeps its Q/DQ, and the GEMMs they feed, in
# float32.
_BFLOAT16_QDQ = "Q/DQ scales stay float32 in a bfloat16 graph"
# At inference BatchNormalization is a per-channel affine op that TensorRT
# folds into the convolution before it; a float32 island would put Casts
# between them and block that fusion. Its values are still measured.
_AFFINE_AT_INFERENCE = ("BatchNormalization",)
# A softmax computed by a layer's own ops rather than a Softmax layer:
# `keras.ops.dot_product_attention` (MultiHeadAttention without dropout)
# upcasts the attention logits to float32 for it under mixed precision.
_SOFTMAX_OPS = ("Softmax", "LogSoftmax")
_SOFTMAX = "Keras computes its softmax in float32"


@dataclasses.dataclass
class Float32Node:
    """One node a strongly typed export kept in float32.

    Attributes:
        node: str. The ONNX node name.
        op_type: str. Its ONNX operator.
        reason: str. One of `REASONS`: `"policy"`, `"magnitude"`,
            `"onnx"`, `"qdq"` or `"layout"`.
        detail: str. The layer, measured value or node behind the reason.
    """

    node: str
    op_type: str
    reason: str
    detail: str


@dataclasses.dataclass
class TypedGraph:
    """What a strongly typed export wrote: its 16-bit type, the float32
    nodes with their reasons, and the Casts at island boundaries.

    Attributes:
        dtype: str. The graph's 16-bit type: `"float16"` or `"bfloat16"`.
        nodes: int. Nodes in the typed graph.
        casts: int. Casts the typed pass added.
        max_magnitude: float. The magnitude threshold.
        measured_samples: int. Inputs the magnitudes were measured on (0:
            not measured).
        rows: list of `Float32Node`, one per node kept float32.

    `print(typed)` gives a summary and one line per float32 node;
    `typed.by_reason()` groups them.

    Example:

    >>> typed = keras_mp.typed_graph("model_fp16.onnx")
    >>> print(typed)
    >>> [(r.node, r.reason) for r in typed.rows]
    """

    dtype: str
    nodes: int
    casts: int
    max_magnitude: float
    measured_samples: int
    rows: list = dataclasses.field(default_factory=list)

    @property
    def float32_nodes(self):
        """Deprecated: `typed.rows`."""
        warnings.warn(
            "TypedGraph.float32_nodes is deprecated: use `typed.rows`. It "
            "will be removed in the next release.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.rows

    def by_reason(self):
        """`{reason: [Float32Node, ...]}` in `REASONS` order."""
        groups = {reason: [] for reason in REASONS}
        for entry in self.rows:
            groups[entry.reason].append(entry)
        return {k: v for k, v in groups.items() if v}

    def __str__(self):
        counts = ", ".join(f"{len(v)} {k}" for k, v in self.by_reason().items())
        measured = (
            f"magnitudes measured on {self.measured_samples} inputs, "
            f"threshold {self.max_magnitude:g}"
            if self.measured_samples
            else "magnitudes not measured (no verify_data)"
        )
        lines = [
            f"{self.dtype} graph: {len(self.rows)} of {self.nodes} "
            f"nodes kept float32 ({counts or 'none'}), {self.casts} Casts; "
            f"{measured}"
        ]
        lines += [
            f"  {e.node} ({e.op_type}): {e.reason}, {e.detail}"
            for e in self.rows
        ]
        return "\n".join(lines)

    def to_dict(self):
        """The report as plain Python (JSON-ready)."""
        return dataclasses.asdict(self)

    def to_metadata(self):
        """The float32 nodes as the JSON stored in the ONNX file (its key
        for the rows: `float32_nodes`, as files have always had it)."""
        data = self.to_dict()
        data["float32_nodes"] = data.pop("rows")
        return json.dumps(data)


def typed_graph(onnx_model):
    """The `TypedGraph` a strongly typed export stored in its file.

    Args:
        onnx_model: str (path) or `onnx.ModelProto` written by
            `export_onnx(..., dtype=...)`.

    Returns:
        `TypedGraph`, or None for a file written without `dtype`.

    Example:

    >>> print(typed_graph("model_fp16.onnx"))
    """
    onnx = optional_import("onnx")
    proto = onnx_model
    if not isinstance(proto, onnx.ModelProto):
        proto = onnx.load(str(onnx_model), load_external_data=False)
    stored = {p.key: p.value for p in proto.metadata_props}.get(METADATA_KEY)
    if stored is None:
        return None
    data = json.loads(stored)
    rows = [Float32Node(**e) for e in data.pop("float32_nodes")]
    return TypedGraph(**data, rows=rows)


def _policy_layers(model):
    """`{id(layer): why}` of the layers that compute in float32 under the
    model's policies: a mixed model's float32-policy layers; for a float32
    model, the layers `apply_mixed_precision` would keep float32
    (normalization, softmax, the output layers), without BatchNorm. Only
    layers without sublayers: a layer with sublayers (a keras-hub encoder
    making a backbone's output) runs its code in the policy, and its
    float32 sublayers are found on their own."""
    from keras_mp.onnx.twin import half_compute_dtype

    mixed = half_compute_dtype(model) is not None
    outputs = _output_layers(model)
    found = {}
    for layer in walk_layers(model):
        kind = type(layer).__name__
        if kind in (*_AFFINE_AT_INFERENCE, "InputLayer"):
            continue
        if next(walk_layers(layer), None) is not None:
            continue  # sublayers (a keras_mp quantizer is not one)
        if mixed:
            if layer.compute_dtype == "float32":
                found[id(layer)] = f"layer {layer.name!r}: float32 policy"
        elif layer_table.keeps_float32(layer):
            found[id(layer)] = (
                f"layer {layer.name!r}: mixed precision keeps {kind} float32"
            )
        elif id(layer) in outputs:
            found[id(layer)] = f"layer {layer.name!r}: output layer"
    return found


def _output_layers(model):
    """Ids of the layers that make `model`'s outputs, looking inside the
    graph models that make them (a quantized model's float model, a
    keras-hub backbone)."""
    keras = optional_import("keras")
    found, stack = set(), [getattr(model, "model", model)]
    while stack:
        for tensor in getattr(stack.pop(), "outputs", None) or []:
            layer = _keras.producer(tensor)
            if isinstance(layer, keras.Model) and _keras.is_graph_model(layer):
                stack.append(layer)
            elif layer is not None:
                found.add(id(layer))
    return found


def _measure(proto, data, samples):
    """`{tensor: max |value|}` of every float tensor of the top-level
    graph, on up to `samples` rows of `data` (a list of arrays), run in
    ONNX Runtime with graph optimizations off."""
    onnx = optional_import("onnx")
    from keras_mp.onnx.parity import run_session, session_for

    exposed = onnx.ModelProto()
    exposed.CopyFrom(proto)
    typed = onnx.shape_inference.infer_shapes(exposed).graph
    names = {o.name for o in exposed.graph.output}
    # stale value_info (tensors a pass removed, e.g. folded weight Q/DQ)
    # would be outputs ONNX Runtime cannot find
    produced = {o for n in exposed.graph.node for o in n.output}
    for value in typed.value_info:
        if (
            value.type.tensor_type.elem_type == FLOAT
            and value.name not in names
            and value.name in produced
        ):
            exposed.graph.output.append(value)
    session = session_for(exposed)  # onnx.reference for NVFP4/MXFP8
    outputs = [o.name for o in session.get_outputs()]
    values = run_session(session, [x[:samples] for x in data], batch_size=16)
    peaks = {
        name: float(np.max(np.abs(v))) if v.size else 0.0
        for name, v in zip(outputs, values)
        if v.dtype.kind == "f"
    }
    for value, x in zip(exposed.graph.input, data):
        if x.dtype.kind == "f":
            peaks[value.name] = float(np.max(np.abs(x[:samples])))
    return peaks


def find_islands(
    proto, model, dtype, data=None, max_magnitude=MAX_MAGNITUDE, samples=64
):
    """The top-level nodes of `proto` to keep in float32, with reasons.

    Args:
        proto: the float32 `onnx.ModelProto` (after weight folding).
        model: the `keras.Model` it was exported from (its layer names
            and dtype policies; a mixed model itself, not its twin).
        dtype: str. The 16-bit type, `"float16"` or `"bfloat16"`.
        data: list of arrays, one per graph input, or None (no magnitude
            rule).
        max_magnitude: float. A node whose float inputs or outputs exceed
            it on `data` stays float32. Defaults to 512 (AutoCast's
            `data_max`).
        samples: int. Rows of `data` measured. Defaults to 64.

    Returns:
        `(islands, measured)`: a dict `{node name: Float32Node}` in graph
        order, and the number of rows measured.
    """
    graph = proto.graph
    nodes = list(graph.node)
    producers = {o: n for n in nodes for o in n.output}
    consumers = {}
    for node in nodes:
        for name in reads(node):
            consumers.setdefault(name, []).append(node)
    found = {}

    def keep(node, reason, detail):
        if node.name not in found:
            found[node.name] = Float32Node(
                node.name, node.op_type, reason, detail
            )

    layers = _policy_layers(model)
    for node in nodes:
        path = keras_layer_path(node.name, model)
        hits = [layers[id(layer)] for layer in path if id(layer) in layers]
        if hits and node.op_type not in _AFFINE_AT_INFERENCE:
            keep(node, "policy", hits[-1])
        elif node.op_type in _SOFTMAX_OPS:
            where = f"layer {path[-1].name!r}" if path else "no Keras layer"
            keep(node, "policy", f"{where}: {_SOFTMAX}")
    _required_float32(nodes, producers, keep)
    if dtype == "bfloat16":
        for node in nodes:
            if node.op_type in QDQ_OPS:
                keep(node, "onnx", _BFLOAT16_QDQ)
    measured = 0
    if data is not None:
        measured = min(samples, len(data[0]))
        peaks = _measure(proto, data, samples)
        for node in nodes:
            if node.op_type in ("Shape", "Size"):
                continue  # they read a shape, not values
            over = [
                (peaks[t], t)
                for t in [*node.input, *node.output]
                if t in peaks and peaks[t] > max_magnitude
            ]
            if over:
                peak, tensor = max(over)
                keep(node, "magnitude", f"max |{tensor}| = {peak:.4g}")
    if dtype == "float16":
        _beyond_float16(graph, consumers, keep)
    _tie_qdq(nodes, producers, consumers, found, keep)
    _follow_layout(graph, producers, consumers, found, keep, model)
    order = {n.name: i for i, n in enumerate(nodes)}
    return dict(sorted(found.items(), key=lambda kv: order[kv[0]])), measured


def _required_float32(nodes, producers, keep):
    """Keeps the computation of an input ONNX requires in float32 (a
    Resize's scales computed at run time) in float32, back to the first
    non-float or constant value."""
    for node in nodes:
        for op_type, slot in KEEP_FLOAT32_INPUTS:
            if node.op_type != op_type or len(node.input) <= slot:
                continue
            stack = [node.input[slot]]
            while stack:
                source = producers.get(stack.pop())
                if source is None or source.op_type in ("Constant", "Cast"):
                    if source is not None:
                        keep(source, "onnx", f"feeds {node.name} (float32)")
                    continue
                keep(source, "onnx", f"feeds {node.name} (float32)")
                stack.extend(source.input)


def _beyond_float16(graph, consumers, keep):
    """Keeps the readers of a constant beyond float16's range (65504,
    AutoCast's `init_max`; a -1e9 attention mask) in float32."""
    from keras_mp.onnx.graph import constant_value

    onnx = optional_import("onnx")
    constants = [
        (i.name, onnx.numpy_helper.to_array(i))
        for i in graph.initializer
        if i.data_type == FLOAT
    ]
    for node in graph.node:
        value = constant_value(node) if node.op_type == "Constant" else None
        if value is not None and value[1] == FLOAT:
            constants.append((node.output[0], value[0]))
    for name, array in constants:
        finite = np.abs(array[np.isfinite(array)])
        if finite.size and finite.max() > _FP16_MAX:
            for node in consumers.get(name, []):
                keep(node, "magnitude", f"constant {name} = {finite.max():.4g}")


def _tie_qdq(nodes, producers, consumers, found, keep):
    """Grows the islands so that a Cast never lands inside a Q/DQ pair or
    between a DequantizeLinear and its Conv/MatMul/Gemm: a QuantizeLinear,
    the DequantizeLinears it feeds (through layout ops) and the weighted
    ops they feed share one precision, float32 when any of them is."""
    by_name = {n.name: n for n in nodes}
    groups = []
    for dq in (n for n in nodes if n.op_type == "DequantizeLinear"):
        group = {dq.name}
        node = producers.get(dq.input[0])
        while node is not None and node.op_type in LAYOUT_OPS:
            group.add(node.name)
            node = producers.get(node.input[0])
        if node is not None and node.op_type == "QuantizeLinear":
            group.add(node.name)
        group |= {
            c.name
            for c in consumers.get(dq.output[0], [])
            if c.op_type in WEIGHT_SLOTS
        }
        groups.append(group)
    changed = True
    while changed:
        changed = False
        for group in groups:
            tied = [found[n] for n in group if n in found]
            if tied and len(tied) < len(group):
                cause = tied[0]
                for name in group - found.keys():
                    keep(
                        by_name[name],
                        "qdq",
                        f"with {cause.node} ({cause.reason})",
                    )
                changed = True


def _follow_layout(graph, producers, consumers, found, keep, model):
    """Keeps the layout ops that belong to no Keras layer (tf2onnx's
    Transposes) in float32 when they only carry a float32 node's values to
    float32 nodes or the graph's outputs: 16-bit there, they would need a
    Cast on each side. One that feeds a 16-bit node stays 16-bit, and the
    island's Cast goes before it, where it halves the bytes it moves."""
    keras = optional_import("keras")
    outputs = {o.name for o in graph.output}
    follow = {
        n.name: n
        for n in graph.node
        if n.op_type in LAYOUT_OPS
        and n.name not in found
        and n.input
        and not any(
            not isinstance(layer, keras.Model)
            for layer in keras_layer_path(n.name, model)
        )
    }

    def float32(name):
        return name in found or name in follow

    changed = True
    while changed:
        changed = False
        for name, node in list(follow.items()):
            source = producers.get(node.input[0])
            readers = [c for o in node.output for c in consumers.get(o, [])]
            if (
                source is None
                or not float32(source.name)
                or not all(float32(c.name) for c in readers)
                or not (readers or set(node.output) & outputs)
            ):
                del follow[name]
                changed = True
    for node in graph.node:
        if node.name in follow:
            source = producers[node.input[0]]
            keep(node, "layout", f"after {source.name}")


def apply_islands(proto, model, traced, dtype, data, max_magnitude):
    """The 16-bit graph of `proto` and its `TypedGraph`: islands chosen
    (`find_islands`), `fp16.to_half` applied, each float32 node's reason
    written into its `doc_string` and the list into the file's metadata
    (`typed_graph` reads it back)."""
    from keras_mp.onnx.fp16 import to_half

    islands, measured = find_islands(proto, model, dtype, data, max_magnitude)
    typed_proto = to_half(proto, dtype, islands, traced)
    casts = len(
        [n for n in typed_proto.graph.node if n.op_type == "Cast"]
    ) - len([n for n in proto.graph.node if n.op_type == "Cast"])
    typed = TypedGraph(
        dtype,
        len(typed_proto.graph.node),
        casts,
        max_magnitude,
        measured,
        list(islands.values()),
    )
    for node in typed_proto.graph.node:
        if node.name in islands:
            entry = islands[node.name]
            node.doc_string = (
                f"keras_mp: float32 ({entry.reason}: {entry.detail})"
            )
    entry = typed_proto.metadata_props.add()
    entry.key, entry.value = METADATA_KEY, typed.to_metadata()
    return typed_proto, typed

"""The TensorRT explicit-quantization contract as a lint over an ONNX graph.

TensorRT builds an INT8 engine from an ONNX graph only when its
QuantizeLinear/DequantizeLinear (Q/DQ) nodes follow a contract (see
DESIGN.md): symmetric INT8, constant positive float32 scales, per-channel
scales only on weights and on their output-channel axis, each weight
DequantizeLinear feeding its weighted op directly, and no QOperator ops.
`check_tensorrt` checks any ONNX graph, ours or anyone's, against it and
against the 2:4 structured-sparsity rule.

Each rule is one function `rule(graph) -> iterable of Finding` listed in
`RULES`: adding a rule is one function and one list entry.
"""

import dataclasses
import os

import numpy as np

from keras_mp._compat import optional_import

# ONNX element types (onnx.TensorProto values, fixed by the ONNX spec);
# spelled out so this module imports without onnx installed.
_FLOAT, _UINT8, _INT8, _INT32, _INT64 = 1, 2, 3, 6, 7

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
QOPERATOR_OPS = frozenset(
    """QLinearConv QLinearMatMul ConvInteger MatMulInteger MatMulIntegerToFloat
    DynamicQuantizeLinear DynamicQuantizeMatMul QGemm QAttention QLinearAdd
    QLinearMul QLinearConcat QLinearAveragePool QLinearGlobalAveragePool
    QLinearLeakyRelu QLinearSigmoid QLinearSoftmax QLinearReduceMean
    QLinearConvTranspose QLinearWhere""".split()
)
# Input slots holding a weight, and the bias slot, of each weighted op.
WEIGHT_SLOTS = {
    "Conv": (1,),
    "ConvTranspose": (1,),
    "MatMul": (0, 1),
    "Gemm": (0, 1),
}
BIAS_SLOT = 2
SPARSE_OPS = ("Conv", "MatMul", "Gemm")
# Ops that only move or relabel values: they may stand between a weight and
# its op in a float graph, but not between a weight's DQ and its op.
LAYOUT_OPS = frozenset(
    {"Transpose", "Reshape", "Identity", "Squeeze", "Unsqueeze", "Flatten"}
)
# Ops through which TensorRT moves a Q/DQ pair on to the next weighted op.
PASS_THROUGH_OPS = LAYOUT_OPS | {"MaxPool", "GlobalMaxPool"}


@dataclasses.dataclass(frozen=True)
class Finding:
    """One broken rule: which rule, on which node, and what to do."""

    rule: str
    node: str
    message: str
    severity: str = "error"

    def __str__(self):
        return f"`{self.node}` [{self.rule}] {self.message}"


@dataclasses.dataclass
class LintReport:
    """What `check_tensorrt` found.

    Attributes:
        source: The file checked, or `"<ModelProto>"`.
        violations: List of `Finding`s that stop a TensorRT INT8 build.
        warnings: List of `Finding`s that cost speed or accuracy.
        num_qdq: Number of QuantizeLinear and DequantizeLinear nodes.
        weighted_ops: Number of Conv, ConvTranspose, MatMul and Gemm nodes.
        weighted_ops_quantized: How many of those have both inputs quantized.
        sparse_weights: Names of the weights that are 2:4 sparse.
    """

    source: str = "<ModelProto>"
    violations: list = dataclasses.field(default_factory=list)
    warnings: list = dataclasses.field(default_factory=list)
    num_qdq: int = 0
    weighted_ops: int = 0
    weighted_ops_quantized: int = 0
    sparse_weights: list = dataclasses.field(default_factory=list)

    @property
    def ok(self):
        """True when nothing stops TensorRT from building the graph."""
        return not self.violations

    def to_markdown(self):
        """The report as Markdown: verdict, counts, then one line a finding."""
        verdict = "PASS" if self.ok else "FAIL"
        counts = [
            f"{len(found)} {kind}{'s' * (len(found) != 1)}"
            for kind, found in (
                ("violation", self.violations),
                ("warning", self.warnings),
            )
        ]
        lines = [
            f"## TensorRT lint: {self.source}: {verdict} ({', '.join(counts)})",
            "",
            f"Q/DQ nodes: {self.num_qdq}. Weighted ops: {self.weighted_ops}, "
            f"with both inputs quantized: {self.weighted_ops_quantized}.",
        ]
        if self.sparse_weights:
            lines.append(
                f"2:4 sparse weights ({len(self.sparse_weights)}): "
                f"{', '.join(self.sparse_weights)}; build with "
                "`trtexec --sparsity=enable`."
            )
        for title, findings in (
            ("Violations", self.violations),
            ("Warnings", self.warnings),
        ):
            if findings:
                lines += ["", f"### {title}", ""]
                lines += [f"- {f}" for f in findings]
        return "\n".join(lines)

    def __str__(self):
        return self.to_markdown()


@dataclasses.dataclass
class _Source:
    """Where a weighted op's input comes from, walking backwards."""

    layout: list  # layout nodes between the op and the DQ (or constant)
    dq: object = None
    q: object = None
    name: str = None  # the constant at the root, if there is one
    array: np.ndarray = None


def _attr(node, name, default):
    for attribute in node.attribute:
        if attribute.name == name:
            helper = optional_import("onnx.helper")
            return helper.get_attribute_value(attribute)
    return default


def _constant_value(node):
    """The value of a Constant node and its ONNX element type, or None."""
    for attribute in node.attribute:
        value = optional_import("onnx.helper").get_attribute_value(attribute)
        if attribute.name == "value":
            array = optional_import("onnx.numpy_helper").to_array(value)
            return array, value.data_type
        if attribute.name.startswith("value_float"):
            return np.asarray(value, np.float32), _FLOAT
        if attribute.name.startswith("value_int"):
            return np.asarray(value, np.int64), _INT64
    return None


class _Graph:
    """An indexed view of an ONNX graph shared by every rule."""

    def __init__(self, model, check_sparsity):
        onnx = optional_import("onnx")
        graph = model.graph
        self.check_sparsity = check_sparsity
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
        try:  # Element types of run-time tensors; lint models it cannot type.
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
            if node.op_type == "Constant" and (value := _constant_value(node)):
                self.constants[node.output[0]] = value[0]
                self.dtypes[node.output[0]] = value[1]
        self.qdq = [n for n in self.nodes if n.op_type in QDQ_OPS]
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
        return self._names[id(node)]

    def const(self, tensor):
        """The value of a constant tensor (through Identity), else None."""
        node = self.producers.get(tensor)
        while node is not None and node.op_type == "Identity":
            tensor, node = node.input[0], self.producers.get(node.input[0])
        return self.constants.get(tensor)

    def trace(self, tensor):
        """Walks back from an op input through layout ops and a Q/DQ pair."""
        source = _Source(layout=[])
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
            else:
                return source
            tensor = node.input[0]
        source.name, source.array = tensor, self.constants[tensor]
        return source

    def quantized_inputs(self, op):
        return [self.trace(t).dq is not None for t in op.input[:2]]

    def feeds_weighted_op(self, tensor, seen=None):
        seen = set() if seen is None else seen
        for node, _ in self.consumers.get(tensor, []):
            if node.op_type in WEIGHT_SLOTS:
                return True
            if node.op_type in PASS_THROUGH_OPS and id(node) not in seen:
                seen.add(id(node))
                if self.feeds_weighted_op(node.output[0], seen):
                    return True
        return False


def _qdq_type(graph, node):
    """ONNX element type of the integer side of a Q/DQ node, or None."""
    if len(node.input) > 2 and node.input[2]:
        return graph.dtypes.get(node.input[2])
    if node.op_type == "QuantizeLinear":
        return _attr(node, "output_dtype", 0) or _UINT8
    return graph.dtypes.get(node.input[0])


def _output_channel_axis(op, slot, rank):
    if op.op_type == "Conv":
        return 0
    if op.op_type == "ConvTranspose":
        return 1
    if op.op_type == "Gemm":
        transposed = _attr(op, "transB" if slot == 1 else "transA", 0)
        return int(bool(transposed) != (slot == 1))
    return rank - 1 if slot == 1 else rank - 2


def _input_channel_axis(op_type, rank, trans_b=False):
    if op_type == "Conv":
        return 1
    if op_type == "Gemm":
        return 1 if trans_b else 0
    return rank - 2


def _bad_groups(array, axis):
    """(groups of 4 with more than 2 non-zeros, all groups) along `axis`."""
    groups = np.moveaxis(np.asarray(array), axis, -1).reshape(-1, 4)
    return int((np.count_nonzero(groups, axis=1) > 2).sum()), len(groups)


def is_2_4_sparse_onnx_weight(array, op_type, trans_b=False):
    """Whether an ONNX weight is 2:4 sparse along its input-channel axis.

    2:4 sparsity, as TensorRT's sparse kernels need it: in every group of 4
    consecutive input channels at least 2 values are zero, for each output
    channel and spatial position. The input channels are axis 1 of a Conv
    weight (OIHW), axis -2 of a MatMul weight (in, out), and axis 0 of a
    Gemm weight (axis 1 with `transB=1`).

    Args:
        array: NumPy array. The weight as stored in the ONNX graph.
        op_type: String. `"Conv"`, `"MatMul"` or `"Gemm"`.
        trans_b: Bool. The Gemm's `transB` attribute. Defaults to `False`.

    Returns:
        True when the weight is 2:4 sparse; False otherwise, including when
        its input channels are not a multiple of 4.

    Raises:
        ValueError: For another `op_type`, or a weight of the wrong rank.

    Example:

    >>> w = np.array([[1.0, 0.0], [0.0, 2.0], [0.0, 0.0], [3.0, 4.0]])
    >>> is_2_4_sparse_onnx_weight(w, "MatMul")
    True
    """
    array = np.asarray(array)
    min_rank = {"Conv": 3, "MatMul": 2, "Gemm": 2}.get(op_type)
    if min_rank is None:
        raise ValueError(
            f"op_type must be one of {SPARSE_OPS}. "
            f"Received: op_type={op_type!r}"
        )
    if array.ndim < min_rank or (op_type == "Gemm" and array.ndim != 2):
        raise ValueError(
            f"A {op_type} weight has rank >= {min_rank}. Received: an array "
            f"of shape {array.shape}."
        )
    axis = _input_channel_axis(op_type, array.ndim, trans_b)
    return array.shape[axis] % 4 == 0 and _bad_groups(array, axis)[0] == 0


def _sparsity_candidates(graph):
    """(op, weight name, array, axis) for each weight 2:4 can apply to."""
    for op, slot, source in graph.weights:
        if op.op_type not in SPARSE_OPS or slot != 1:
            continue
        if any(n.op_type != "Identity" for n in source.layout):
            continue  # a moved weight: its input channels are not known here
        array = source.array
        axis = _input_channel_axis(
            op.op_type, array.ndim, _attr(op, "transB", 0)
        )
        if array.ndim >= 2 and array.shape[axis] % 4 == 0:
            yield op, source.name, array, axis


def _rule_qoperator(graph):
    for node in graph.nodes:
        if node.op_type in QOPERATOR_OPS:
            yield Finding(
                "qoperator",
                graph.name(node),
                f"{node.op_type} is a QOperator-format op; TensorRT accepts "
                "only QuantizeLinear/DequantizeLinear pairs around float ops: "
                "re-export in QDQ format (ONNX Runtime: "
                "quant_format=QuantFormat.QDQ).",
            )
        elif node.op_type in QDQ_OPS and node.domain not in ("", "ai.onnx"):
            yield Finding(
                "qoperator",
                graph.name(node),
                f"{node.op_type} from domain '{node.domain}'; TensorRT parses "
                "only the standard ONNX QuantizeLinear/DequantizeLinear.",
            )


def _rule_zero_point(graph):
    for node in graph.qdq:
        has_zero_point = len(node.input) > 2 and node.input[2]
        dtype = _qdq_type(graph, node)
        message = None
        if dtype == _INT32:
            message = (
                "dequantizes an INT32 tensor (a quantized bias); TensorRT "
                "quantizes biases itself and takes INT8 Q/DQ only: keep the "
                "bias float32 (ONNX Runtime: extra_options QuantizeBias=False)."
            )
        elif dtype is not None and dtype != _INT8:
            kind = optional_import("onnx").TensorProto.DataType.Name(dtype)
            missing = "" if has_zero_point else "has no zero point, so it "
            message = (
                f"{missing}quantizes to {kind}; TensorRT needs INT8 with zero "
                "point 0: give it an INT8 zero point of 0 (ONNX Runtime: "
                "activation_type=QuantType.QInt8)."
            )
        elif has_zero_point:
            zero_point = graph.const(node.input[2])
            if zero_point is None:
                message = (
                    f"zero point '{node.input[2]}' is computed at run time; "
                    "TensorRT needs a constant INT8 zero point of 0."
                )
            elif np.any(zero_point != 0):
                values = np.unique(zero_point)[:4].tolist()
                message = (
                    f"zero point is {values}, not 0 (asymmetric); TensorRT "
                    "quantization is symmetric: use zero point 0 (ONNX "
                    "Runtime: extra_options ActivationSymmetric=True, "
                    "WeightSymmetric=True)."
                )
        if message:
            yield Finding("zero_point", graph.name(node), message)


def _rule_scale(graph):
    for node in graph.qdq:
        tensor = node.input[1]
        scale = graph.const(tensor)
        if scale is None:
            producer = graph.producers.get(tensor)
            origin = (
                f"computed at run time by {producer.op_type} "
                f"'{graph.name(producer)}'"
                if producer is not None
                else "a graph input"
            )
            message = (
                f"scale '{tensor}' is {origin}; TensorRT needs a constant: "
                "calibrate and store the scale as a float32 initializer."
            )
        elif scale.dtype != np.float32 and not (
            scale.dtype == np.float16 and graph.opset >= 19
        ):
            message = (
                f"scale '{tensor}' is {scale.dtype}; TensorRT needs float32 "
                "(or float16 at opset >= 19, for a float16 graph)."
            )
        elif not np.all(np.isfinite(scale) & (scale > 0)):
            bad = scale[~(np.isfinite(scale) & (scale > 0))].ravel()
            message = (
                f"scale '{tensor}' has {bad.size} value(s) that are not "
                f"positive and finite (e.g. {bad[0]}); an uncalibrated "
                "quantizer (amax 0) gives scale 0: calibrate it."
            )
        else:
            continue
        yield Finding("scale", graph.name(node), message)


def _rule_per_channel(graph):
    for node in graph.qdq:
        scale = graph.const(node.input[1])
        if scale is None or scale.size <= 1:
            continue
        name = graph.name(node)
        axis = _attr(node, "axis", 1)
        if graph.opset < 13:
            yield Finding(
                "per_channel",
                name,
                f"per-channel scale needs opset >= 13; the graph has opset "
                f"{graph.opset}: export with opset 13 or later.",
            )
        use = graph.weight_use.get(id(node))
        if use is None:
            yield Finding(
                "per_channel",
                name,
                f"per-channel scale ({scale.size} values, axis {axis}) on "
                "a tensor that is not the weight of a Conv, ConvTranspose, "
                "MatMul or Gemm; TensorRT quantizes activations per-tensor: "
                "use a scalar scale.",
            )
            continue
        op, slot, source = use
        if slot == BIAS_SLOT or source.layout:
            continue  # reported by the zero_point / weight_dq_direct rules
        shape = source.array.shape
        expected = _output_channel_axis(op, slot, len(shape))
        if (axis + len(shape) if axis < 0 else axis) != expected:
            yield Finding(
                "per_channel",
                name,
                f"per-channel axis {axis} on the weight of {op.op_type} "
                f"'{graph.name(op)}' (shape {list(shape)}); its output-"
                f"channel axis is {expected} (Conv: 0, OIHW; ConvTranspose: "
                "1; MatMul: last; Gemm: 1, or 0 with transB=1).",
            )
        elif scale.size != shape[expected]:
            yield Finding(
                "per_channel",
                name,
                f"{scale.size} scales for {shape[expected]} output channels "
                f"of {op.op_type} '{graph.name(op)}'.",
            )


def _rule_weight_dq_direct(graph):
    for op, slot, source in graph.weights:
        if source.dq is None or not source.layout:
            continue
        chain = ", ".join(
            f"{n.op_type} '{graph.name(n)}'" for n in reversed(source.layout)
        )
        yield Finding(
            "weight_dq_direct",
            graph.name(op),
            f"weight DequantizeLinear '{graph.name(source.dq)}' reaches input "
            f"{slot} through {chain}; TensorRT needs the weight DQ to feed "
            f"the {op.op_type} directly: fold these ops into the weight "
            "initializer.",
        )


def _rule_partial_quantization(graph):
    for op in graph.weighted:
        quantized = graph.quantized_inputs(op)
        if len(quantized) == 2 and quantized[0] != quantized[1]:
            missing = op.input[quantized.index(False)]
            yield Finding(
                "partial_quantization",
                graph.name(op),
                f"only one input is quantized ('{missing}' is not); TensorRT "
                f"runs the {op.op_type} in INT8 only when both input and "
                "weight are: add Q/DQ on the other input too.",
                "warning",
            )


def _rule_output_qdq(graph):
    for op in graph.weighted:
        for q, _ in graph.consumers.get(op.output[0], []):
            if q.op_type != "QuantizeLinear":
                continue
            dqs = [n for n, _ in graph.consumers.get(q.output[0], [])]
            if not any(graph.feeds_weighted_op(n.output[0]) for n in dqs):
                yield Finding(
                    "output_qdq",
                    graph.name(q),
                    f"Q/DQ on the output of {op.op_type} '{graph.name(op)}' "
                    "feeds no weighted op; TensorRT fuses Q/DQ on the inputs "
                    "of weighted ops, so this pair may only add latency.",
                    "warning",
                )


def _from_quantized_weighted_op(graph, tensor):
    """The quantized weighted op behind `tensor`, through a BatchNormalization
    or the Mul/Add-by-constant pair tf2onnx decomposes an inference-mode
    Keras BatchNormalization into (TensorRT folds both into the conv)."""
    node = graph.producers.get(tensor)
    for _ in range(4):
        if node is None:
            break
        if node.op_type == "BatchNormalization":
            node = graph.producers.get(node.input[0])
        elif node.op_type in ("Mul", "Add") and len(node.input) == 2:
            consts = [graph.trace(t).name is not None for t in node.input]
            if consts.count(True) != 1:
                break
            node = graph.producers.get(node.input[consts.index(False)])
        else:
            break
    if node is None or node.op_type not in WEIGHT_SLOTS:
        return None
    return node if any(graph.quantized_inputs(node)) else None


def _rule_residual_add(graph):
    for node in graph.nodes:
        if node.op_type != "Add" or len(node.input) != 2:
            continue
        sources = [graph.trace(t) for t in node.input]
        if any(s.name is not None for s in sources):
            continue  # a bias add, not a residual one
        quantized = [s.dq is not None for s in sources]
        ops = [_from_quantized_weighted_op(graph, t) for t in node.input]
        for i, j in ((0, 1), (1, 0)):
            if quantized[j] or ops[j] is not None:
                continue
            if ops[i] is not None:
                reason = (
                    f"put Q/DQ on the skip input '{node.input[j]}' so "
                    f"TensorRT fuses {ops[i].op_type} '{graph.name(ops[i])}' "
                    "and this Add into one INT8 kernel."
                )
            elif quantized[i]:
                reason = (
                    f"input '{node.input[i]}' is quantized but "
                    f"'{node.input[j]}' is not: quantize both or neither."
                )
            else:
                continue
            yield Finding("residual_add", graph.name(node), reason, "warning")
            break


def _rule_sparsity(graph):
    if graph.check_sparsity is False:
        return
    for op, weight, array, axis in _sparsity_candidates(graph):
        bad, total = _bad_groups(array, axis)
        zeros = float(np.mean(array == 0))
        if bad == 0 or (graph.check_sparsity == "auto" and zeros < 0.4):
            continue
        looks = f"looks pruned ({zeros:.0%} zeros) but " if zeros >= 0.4 else ""
        yield Finding(
            "sparsity_2_4",
            graph.name(op),
            f"weight '{weight}' {looks}breaks 2:4: {bad} of {total} groups of "
            f"4 input channels (axis {axis}) have more than 2 non-zeros; "
            "prune with keras_mp.StructuredSparsity and keep its mask.",
        )


RULES = [
    _rule_qoperator,
    _rule_zero_point,
    _rule_scale,
    _rule_per_channel,
    _rule_weight_dq_direct,
    _rule_partial_quantization,
    _rule_output_qdq,
    _rule_residual_add,
    _rule_sparsity,
]


def _load(model):
    onnx = optional_import("onnx")
    if isinstance(model, onnx.ModelProto):
        return model, "<ModelProto>"
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(
            "check_tensorrt expects an ONNX file path or an onnx.ModelProto. "
            f"Received: {type(model).__name__}"
        )
    path = os.fspath(model)
    if not os.path.isfile(path):
        raise ValueError(
            f"No ONNX file at '{path}'. Received: onnx_path={path!r}"
        )
    try:
        proto = onnx.load(path)
    except Exception as e:  # protobuf raises several types on junk bytes
        raise ValueError(
            f"'{path}' is not a readable ONNX model ({type(e).__name__}: {e})."
        ) from e
    if proto.ir_version == 0 or not proto.opset_import:
        raise ValueError(
            f"'{path}' is not an ONNX model (no IR version or opset)."
        )
    return proto, path


def check_tensorrt(model, check_sparsity="auto", strict=False):
    """Lints an ONNX graph against the TensorRT explicit-quantization contract.

    Checks every node against each rule in `RULES`: no QOperator ops; INT8
    Q/DQ with zero point 0; constant, positive, finite float32 scales;
    per-channel scales only on weights, on their output-channel axis (and
    opset >= 13); each weight DequantizeLinear feeding its Conv,
    ConvTranspose, MatMul or Gemm directly; and the 2:4 sparsity rule.
    Placement that TensorRT builds but runs slower (one input of a weighted
    op quantized, Q/DQ on a weighted op's output feeding no weighted op, a
    residual Add whose skip input is not quantized) gives warnings.

    Args:
        model: String, path-like or `onnx.ModelProto`. The ONNX model.
        check_sparsity: `"auto"`, `True` or `False`. `"auto"`: a Conv,
            MatMul or Gemm weight with >= 40% zeros that is not 2:4 sparse
            is a violation. `True`: every such weight whose input channels
            are a multiple of 4 must be 2:4 sparse. `False`: skip the rule.
            2:4 sparse weights are listed in the report unless `False`.
            Defaults to `"auto"`.
        strict: Bool. Whether warnings count as violations. Defaults to
            `False`.

    Returns:
        A `LintReport`; `report.ok` is False when TensorRT cannot build the
        graph as intended, and `print(report)` lists per node what broke
        which rule and what to do.

    Raises:
        ValueError: For a path that is not an ONNX file, or a wrong
            `check_sparsity`.
        TypeError: For a `model` that is neither a path nor a ModelProto.

    Example:

    ```python
    report = keras_mp.check_tensorrt("model.onnx")
    print(report)  # per node: which rule broke, and what to do
    if not report.ok:
        raise SystemExit(1)
    ```
    """
    if check_sparsity not in ("auto", True, False):
        raise ValueError(
            "check_sparsity must be 'auto', True or False. Received: "
            f"check_sparsity={check_sparsity!r}"
        )
    proto, source = _load(model)
    graph = _Graph(proto, check_sparsity)
    findings = [finding for rule in RULES for finding in rule(graph)]
    if strict:
        findings = [dataclasses.replace(f, severity="error") for f in findings]
    sparse = []
    if check_sparsity is not False:
        sparse = [
            weight
            for _, weight, array, axis in _sparsity_candidates(graph)
            if _bad_groups(array, axis)[0] == 0
        ]
    return LintReport(
        source=source,
        violations=[f for f in findings if f.severity == "error"],
        warnings=[f for f in findings if f.severity != "error"],
        num_qdq=len(graph.qdq),
        weighted_ops=len(graph.weighted),
        weighted_ops_quantized=sum(
            all(graph.quantized_inputs(op)) for op in graph.weighted
        ),
        sparse_weights=sparse,
    )


def _dynamic_shapes(proto, batch):
    """`--minShapes/--optShapes/--maxShapes` for inputs with a dynamic
    batch axis (Keras exports batch as `None`)."""
    initializers = {i.name for i in proto.graph.initializer}
    specs = {"min": [], "opt": [], "max": []}
    for value in proto.graph.input:
        if value.name in initializers:
            continue
        dims = value.type.tensor_type.shape.dim
        if not dims or any(d.dim_value <= 0 for d in dims[1:]):
            continue  # unknown non-batch dims: the user has to say
        if dims[0].dim_value > 0:
            continue  # static batch: nothing to choose
        rest = "x".join(str(d.dim_value) for d in dims[1:])
        for key, size in zip(("min", "opt", "max"), batch):
            specs[key].append(f"{value.name}:{size}x{rest}")
    if not specs["min"]:
        return ""
    return "".join(
        f" --{key}Shapes={','.join(values)}" for key, values in specs.items()
    )


def trtexec_command(onnx_path, report=None, batch=(1, 32, 128), legacy=False):
    """The TensorRT `trtexec` command that fits this ONNX file.

    `--stronglyTyped` takes the precisions from the Q/DQ graph (TensorRT 10
    and 11; TensorRT 11 removed `--int8 --fp16`); `--sparsity=enable` when
    2:4 weights are present; `--minShapes/--optShapes/--maxShapes` for a
    dynamic batch axis.

    Args:
        onnx_path: str. The ONNX file.
        report: `LintReport` of that file, if already computed.
        batch: (min, opt, max) batch sizes of the optimization profile.
            Defaults to (1, 32, 128).
        legacy: bool. Use TensorRT 8-10's weakly typed `--int8 --fp16`
            instead of `--stronglyTyped`. Defaults to False.

    Returns:
        The command line, as a string.
    """
    if (
        len(batch) != 3
        or not all(isinstance(b, int) and b > 0 for b in batch)
        or not batch[0] <= batch[1] <= batch[2]
    ):
        raise ValueError(
            "batch must be three positive ints (min, opt, max) with min <= "
            f"opt <= max. Received: batch={batch!r}"
        )
    proto, _ = _load(onnx_path)
    report = report or check_tensorrt(proto)
    engine = os.path.splitext(os.fspath(onnx_path))[0] + ".engine"
    command = f"trtexec --onnx={onnx_path} --saveEngine={engine}"
    command += " --int8 --fp16" if legacy else " --stronglyTyped"
    command += _dynamic_shapes(proto, batch)
    if report.sparse_weights:
        command += " --sparsity=enable"
    return command

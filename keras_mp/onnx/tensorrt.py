"""`check_tensorrt`: an ONNX graph linted against the TensorRT
explicit-quantization contract (`docs/tensorrt.md`), and the 2:4 check of
an ONNX weight."""

import dataclasses
import os

import numpy as np

from keras_mp._compat import optional_import
from keras_mp.onnx.graph import input_channel_axis
from keras_mp.onnx.rules import (
    RULES,
    SPARSE_OPS,
    LintGraph,
    bad_groups,
    sparsity_candidates,
)


@dataclasses.dataclass
class LintReport:
    """What `check_tensorrt` found.

    Attributes:
        source: The file checked, or `"<ModelProto>"`.
        violations: List of `Finding`s that stop a TensorRT INT8 build.
        warnings: List of `Finding`s that cost speed or accuracy.
        num_qdq: Number of QuantizeLinear and DequantizeLinear nodes.
        weighted_ops: Number of Conv, ConvTranspose, MatMul and Gemm nodes,
            plus recurrent ops (LSTM, GRU, RNN) and weighted ops inside
            Loop/Scan/If bodies, which TensorRT runs in float.
        weighted_ops_quantized: How many of those have both inputs quantized.
        sparse_weights: Names of the weights that are 2:4 sparse.

    Example:

    >>> report = keras_mp.check_tensorrt("model.onnx")
    >>> report.ok, report.weighted_ops_quantized, report.weighted_ops
    >>> print(report.to_markdown())
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

    @property
    def rows(self):
        """Every `Finding`: the violations, then the warnings (each says
        which by its `severity`)."""
        return self.violations + self.warnings

    def to_dict(self):
        """The report as plain Python (JSON-ready), with `ok`."""
        return dict(dataclasses.asdict(self), ok=self.ok)

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
    axis = input_channel_axis(op_type, array.ndim, trans_b)
    return array.shape[axis] % 4 == 0 and bad_groups(array, axis)[0] == 0


def load_onnx(model):
    """(ModelProto, source name) of a path or a ModelProto, checked."""
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
    proto, source = load_onnx(model)
    graph = LintGraph(proto, check_sparsity)
    findings = [finding for rule in RULES for finding in rule(graph)]
    if strict:
        findings = [dataclasses.replace(f, severity="error") for f in findings]
    sparse = []
    if check_sparsity is not False:
        sparse = [
            weight
            for _, weight, array, axis in sparsity_candidates(graph)
            if bad_groups(array, axis)[0] == 0
        ]
    return LintReport(
        source=source,
        violations=[f for f in findings if f.severity == "error"],
        warnings=[f for f in findings if f.severity != "error"],
        num_qdq=len(graph.qdq),
        weighted_ops=len(graph.weighted) + len(graph.float_weighted),
        weighted_ops_quantized=sum(
            all(graph.quantized_inputs(op)) for op in graph.weighted
        ),
        sparse_weights=sparse,
    )

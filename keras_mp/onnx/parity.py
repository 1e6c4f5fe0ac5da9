"""Keras vs ONNX Runtime on the same inputs: `verify_onnx`, and the ONNX
Runtime session helpers the demo's latency figures use too."""

import contextlib
import dataclasses
import os
import re
import warnings

import numpy as np

from keras_mp import _inputs, _keras
from keras_mp._compat import optional_import
from keras_mp.onnx.errors import ExportError, ParityError
from keras_mp.onnx.graph import FLOAT8E4M3FN

# Unit roundoff (half the distance from 1 to the next value) of the float
# type a graph computes in: the relative error of one rounding.
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
# A prediction is a near-tie when Keras' top-1 margin is within this many
# unit roundoffs of its largest |logit|: twice the worst per-logit error
# measured on an INT8 CNN's float16 graph (36; docs/export.md, "Parity").
NEAR_TIE_ROUNDOFFS = 64


@dataclasses.dataclass
class ParityReport:
    """Keras vs ONNX Runtime on the same inputs.

    The figures are the worst over the model's outputs; `rows` holds one
    `OutputParity` per output (by Keras output name), which `print(report)`
    lists when there are several. `typed` is the `TypedGraph` of a
    strongly typed export (`export_onnx(dtype=...)`): which nodes stayed
    float32, and why.

    Example:

    >>> report = keras_mp.verify_onnx(model, "model.onnx", x_test[:512])
    >>> print(report)
    >>> [(r.name, r.rel_l2) for r in report.rows]
    """

    samples: int
    top1_agreement: float
    max_abs_diff: float
    mean_abs_diff: float
    rel_l2: float
    optimized_top1_agreement: float = None
    optimized_rel_l2: float = None
    rows: list = dataclasses.field(default_factory=list)
    note: str = ""
    typed: object = None
    near_ties: int = 0
    dtype: str = "float32"
    runtime: str = "ONNX Runtime"

    @property
    def outputs(self):
        """Deprecated: `report.rows`."""
        warnings.warn(
            "ParityReport.outputs is deprecated: use `report.rows`. It will "
            "be removed in the next release.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.rows

    def to_dict(self):
        """The report as plain Python (JSON-ready)."""
        return dataclasses.asdict(self)

    def __str__(self):
        ties = (
            f" ({self.near_ties} near-tie prediction(s) not counted: Keras' "
            f"top-1 margin within the {self.dtype} graph's expected error)"
            if self.near_ties
            else ""
        )
        text = (
            f"{self.runtime} parity on {self.samples} inputs (graph "
            f"optimizations off): top-1 agreement "
            f"{100 * self.top1_agreement:.2f}%{ties}, relative L2 "
            f"{self.rel_l2:.2e}, max |diff| {self.max_abs_diff:.3g}, mean "
            f"|diff| {self.mean_abs_diff:.3g}"
        )
        if self.optimized_top1_agreement is not None:
            text += (
                f"; with ORT's default optimizations: top-1 agreement "
                f"{100 * self.optimized_top1_agreement:.2f}%, relative L2 "
                f"{self.optimized_rel_l2:.2e}"
            )
        if self.note:
            text += f" ({self.note})"
        if len(self.rows) > 1:
            text += "".join(
                f"\n  output {r.name!r}: top-1 agreement "
                f"{100 * r.top1_agreement:.2f}%, relative L2 {r.rel_l2:.2e}, "
                f"max |diff| {r.max_abs_diff:.3g}"
                for r in self.rows
            )
        if self.typed is not None:
            text += f"\n{self.typed}"
        return text


def ort_session(path, optimized=True):
    """An ONNX Runtime CPU session on the file at `path`.

    Args:
        path: str. The `.onnx` file (or its serialized bytes).
        optimized: bool. ORT's default graph optimizations; False runs the
            graph as written (Q/DQ semantics). Defaults to True.

    Returns:
        An `onnxruntime.InferenceSession`.
    """
    ort = optional_import("onnxruntime")
    options = ort.SessionOptions()
    if not optimized:
        options.graph_optimization_level = (
            ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        )
    return ort.InferenceSession(
        path if isinstance(path, bytes) else str(path),
        options,
        providers=["CPUExecutionProvider"],
    )


# Element types ONNX Runtime 1.32's CPU provider cannot dequantize
# (NOT_IMPLEMENTED): FLOAT4E2M1 codes (NVFP4) and FLOAT8E8M0 scales (MXFP8).
_REFERENCE_ONLY_TYPES = frozenset({23, 24})
REFERENCE_NOTE = (
    "NVFP4/MXFP8 graph: ONNX Runtime 1.32's CPU provider cannot dequantize "
    "FLOAT4E2M1 or FLOAT8E8M0 nor run TensorRT's trt-domain "
    "DynamicQuantize, so parity is checked with "
    "onnx.reference.ReferenceEvaluator (keras_mp implements the "
    "DynamicQuantize ops for it), and there is no optimized figure"
)


class ReferenceSession:
    """`onnx.reference.ReferenceEvaluator` behind the few methods of an
    `onnxruntime.InferenceSession` that `run_session` and `check_parity`
    call, for graphs ONNX Runtime cannot run."""

    def __init__(self, path):
        onnx = optional_import("onnx")
        from keras_mp.onnx.dynamic_blocks import reference_evaluator

        self.proto = (
            onnx.load_from_string(path)
            if isinstance(path, bytes)
            else onnx.load(path)
        )
        # with TensorRT's DynamicQuantize ops (`dynamic_blocks`)
        self.evaluator = reference_evaluator(self.proto)
        inits = {i.name for i in self.proto.graph.initializer}
        self.inputs = [i for i in self.proto.graph.input if i.name not in inits]

    def get_inputs(self):
        return self.inputs

    def get_outputs(self):
        return list(self.proto.graph.output)

    def run(self, names, feeds):
        return self.evaluator.run(names, feeds)


def reference_only(proto):
    """Whether `proto` holds initializers ONNX Runtime cannot dequantize,
    or TensorRT's trt-domain DynamicQuantize (NVFP4/MXFP8 activations)."""
    from keras_mp.onnx.dynamic_blocks import has_dynamic_ops

    return has_dynamic_ops(proto) or any(
        i.data_type in _REFERENCE_ONLY_TYPES for i in proto.graph.initializer
    )


def session_for(proto, optimized=False):
    """An ONNX Runtime session on `proto`, or a `ReferenceSession` when
    ONNX Runtime cannot run it (`reference_only`)."""
    data = proto.SerializeToString()
    if reference_only(proto):
        return ReferenceSession(data)
    return ort_session(data, optimized=optimized)


def run_session(session, inputs, batch_size=512):
    """Runs `session` on `inputs` in batches.

    Args:
        session: an `onnxruntime.InferenceSession`.
        inputs: list of NumPy arrays, one per graph input, in order.
        batch_size: int. Defaults to 512.

    Returns:
        The list of outputs, each concatenated over the batches; an output
        without a batch axis (0-d, a scalar the graph computes) as one
        value per batch.
    """
    names = [i.name for i in session.get_inputs()]
    batches = [
        session.run(
            None,
            {name: x[i : i + batch_size] for name, x in zip(names, inputs)},
        )
        for i in range(0, len(inputs[0]), batch_size)
    ]
    return [
        np.stack(outs) if np.ndim(outs[0]) == 0 else np.concatenate(outs)
        for outs in zip(*batches)
    ]


def verify_inputs(model, data):
    """`data` as a list of arrays, one per model input, each of its input's
    dtype (integer token ids stay integers), checked. A tf.data.Dataset or
    iterable of batches (labels ignored) is read to its end and
    concatenated."""
    specs = _inputs.input_specs(model, "verify_onnx", ExportError)
    if specs is None:
        raise ExportError(
            f"Model {model.name!r} is a subclassed keras.Model without "
            "symbolic inputs: wrap it in a functional model to verify it."
        )
    what = "`verify_data`"
    if isinstance(data, (np.ndarray, dict, list, tuple)) or not hasattr(
        data, "__iter__"
    ):
        return _inputs.as_input_list(data, specs, what, ExportError)
    if isinstance(data, (str, bytes)):
        raise ExportError(
            f"{what} must be arrays, a tf.data.Dataset or an iterable of "
            f"batches. Received: {type(data).__name__}"
        )
    batches = [
        _inputs.as_input_list(
            _inputs.strip_labels(b, len(specs)), specs, what, ExportError
        )
        for b in data
    ]
    if not batches:
        raise ExportError(f"{what} is empty: pass some real inputs.")
    return [np.concatenate(parts) for parts in zip(*batches)]


def output_names(out, model):
    """Names for the flattened outputs `out` (a tensor, list or dict) of
    `model`: the dict keys, sorted as `tf.nest.flatten` orders them, or the
    names of the layers that produce the outputs (`_output_name`), or
    `output_<k>` when those are unknown or fewer than the outputs."""
    if isinstance(out, dict):
        return sorted(out)
    from keras_mp import _record

    if isinstance(model, _record.RecordedModel):
        # The float model's output layers name the outputs (`cls`, `reg`;
        # a Sequential model's last layer), as in its own export.
        names = _producer_names(model.model)
        count = len(out) if isinstance(out, (list, tuple)) else 1
        if len(names) == count:
            return names
    layers = [_keras.producer(t) for t in getattr(model, "outputs", None) or []]
    names = [_output_name(layer) for layer in layers if layer is not None]
    count = len(out) if isinstance(out, (list, tuple)) else 1
    return (
        names if len(names) == count else [f"output_{k}" for k in range(count)]
    )


def _producer_names(model):
    """`_output_name` of the layers producing `model`'s outputs ([] when
    they are unknown: a subclassed model)."""
    try:
        outputs = getattr(model, "outputs", None) or []
    except (AttributeError, ValueError):
        return []
    layers = [_keras.producer(t) for t in outputs]
    return [_output_name(layer) for layer in layers if layer is not None]


def _output_name(layer):
    """The name of an output produced by `layer`: its own name, except for
    a nested model Keras named itself (a keras-hub backbone or subclassed
    model created without a name, the float model inside a
    `RecordedModel`), whose name carries a counter of the models of its
    class the process built before (`deberta_v3_backbone_1`): with one
    output, the name of the layer producing that output (recursively), so
    wrapping or quantizing a model does not rename its output; with
    several, the class name in snake case (`deberta_v3_backbone`)."""
    import keras

    while (
        isinstance(layer, keras.Model)
        and _generated(layer) is not None
        and len(getattr(layer, "outputs", None) or []) == 1
        and _keras.producer(layer.outputs[0]) is not None
    ):
        layer = _keras.producer(layer.outputs[0])
    if isinstance(layer, keras.Model):
        return _generated(layer) or layer.name
    return layer.name


def _snake_case(class_name):
    """A class name as Keras turns it into a default layer name
    (`DebertaV3Backbone` -> `deberta_v3_backbone`)."""
    name = re.sub(r"\W+", "", class_name)
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()


def _generated(layer):
    """The class name (in snake case) Keras made `layer.name` from, plus a
    counter, or None for a name the user gave. Base classes count: a
    quantized `Dense` named `dense_3` is a `dense`."""
    for cls in type(layer).__mro__:
        base = _snake_case(cls.__name__)
        if re.fullmatch(rf"{re.escape(base)}(_\d+)?", layer.name):
            return base
    return None


def flat_outputs(out):
    """`out` (a tensor, list or dict) as a list, dict values by sorted key."""
    if isinstance(out, dict):
        return [out[k] for k in sorted(out)]
    return list(out) if isinstance(out, (list, tuple)) else [out]


@dataclasses.dataclass
class OutputParity:
    """Keras vs ONNX Runtime on one model output."""

    name: str
    top1_agreement: float
    max_abs_diff: float
    mean_abs_diff: float
    rel_l2: float
    near_ties: int = 0


def _top1(w, g, dtype):
    """Top-1 agreement of `g` with `w` over the predictions (rows of the
    last axis) that are not near-ties, and the number of near-ties: rows
    whose top-1 margin in `w` is within `NEAR_TIE_ROUNDOFFS` unit
    roundoffs of `dtype` of their largest |value|, where the graph's own
    rounding may pick either class."""
    w = w.reshape(-1, w.shape[-1]).astype(np.float64)
    g = g.reshape(-1, g.shape[-1])
    top2 = np.sort(w, axis=-1)[:, -2:]
    tolerance = NEAR_TIE_ROUNDOFFS * UNIT_ROUNDOFF[dtype]
    decided = top2[:, 1] - top2[:, 0] > tolerance * np.abs(w).max(-1)
    if not decided.any():
        return 1.0, len(w)
    agree = w[decided].argmax(-1) == g[decided].argmax(-1)
    return float(np.mean(agree)), int(np.sum(~decided))


def _compare_one(name, w, g, dtype):
    diff = np.abs(w.astype(np.float64) - g.astype(np.float64))
    agree, ties = 1.0, 0
    if w.ndim >= 2 and w.shape[-1] > 1 and w.dtype.kind == "f":
        agree, ties = _top1(w, g, dtype)
    norm = max(float(np.linalg.norm(w.astype(np.float64))), 1e-12)
    return OutputParity(
        name,
        agree,
        float(diff.max()),
        float(diff.mean()),
        float(np.linalg.norm(diff)) / norm,
        ties,
    )


def _compare(want, got, names, dtype="float32"):
    """One `OutputParity` per output, in order; top-1 agreement leaves out
    the near-ties of a graph computing in `dtype`."""
    return [_compare_one(n, w, g, dtype) for n, w, g in zip(names, want, got)]


def check_tolerances(min_top1_agreement, max_rel_l2, error=ValueError):
    """Raises `error` unless `min_top1_agreement` is a fraction in [0, 1]
    and `max_rel_l2` a positive number (`inf`: no limit, to measure only)."""
    if (
        isinstance(min_top1_agreement, bool)
        or not isinstance(min_top1_agreement, (int, float, np.floating))
        or not 0 <= min_top1_agreement <= 1
    ):
        hint = (
            f" (a percentage? pass {min_top1_agreement / 100:g})"
            if isinstance(min_top1_agreement, (int, float, np.floating))
            and 1 < min_top1_agreement <= 100
            else ""
        )
        raise error(
            "`min_top1_agreement` is the fraction of predictions that must "
            f"agree, in [0, 1]{hint}. Received: "
            f"min_top1_agreement={min_top1_agreement!r}"
        )
    if (
        isinstance(max_rel_l2, bool)
        or not isinstance(max_rel_l2, (int, float, np.floating))
        or not 0 < max_rel_l2 <= np.inf
    ):
        raise error(
            "`max_rel_l2` is the largest relative L2 difference of the "
            "outputs allowed, a positive number (e.g. 0.01; inf measures "
            "without a limit). "
            f"Received: max_rel_l2={max_rel_l2!r}"
        )


def _keras_outputs(model, inputs, serve=None, batch_size=512):
    """The model's outputs on `inputs` (float ones as float32) and their
    names: through `serve` (the function export_onnx already traced, so no
    second trace) or `model.predict`."""
    if serve is None:
        specs = _inputs.input_specs(model, "verify_onnx", ExportError)
        out = model.predict(
            _inputs.call_arg(model, inputs, specs),
            batch_size=batch_size,
            verbose=0,
        )
        names = output_names(out, model)
        want = [np.asarray(w) for w in flat_outputs(out)]
        return [
            w.astype(np.float32) if w.dtype.kind == "f" else w for w in want
        ], names
    chunks = [
        serve(*[a[i : i + batch_size] for a in inputs])
        for i in range(0, len(inputs[0]), batch_size)
    ]
    want = [
        np.concatenate([np.asarray(c[k]) for c in chunks])
        for k in range(len(chunks[0]))
    ]
    return want, serve.output_names


@contextlib.contextmanager
def _ort_errors(model, onnx_path, what):
    """Within the block, a failure of ONNX Runtime itself (its own
    exception types, raised from its C++ core) becomes an `ExportError`
    that says what failed and what to do."""
    try:
        yield
    except Exception as e:
        if not type(e).__module__.startswith("onnxruntime"):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if "ShapeInferenceError" in first:
            why = (
                "The shapes tf2onnx wrote do not fit together at the node "
                "named above (the float export of the same model fails the "
                "same way when the cause is tf2onnx's conversion, as "
                "keras-hub's tiny DepthAnythingBackbone in bench_hub). Try "
                "the float model first; fixed input sizes (a model built "
                "for the size it will run at) often avoid it."
            )
        else:
            why = (
                "Its CPU provider rejects an operator or a mix of element "
                "types in the graph (for example float16 meeting bfloat16: "
                "a layer left computing in 16 bits, which `keras_mp."
                "mixed_precision_audit(model)` lists). Export the float32 "
                "model (or `dtype='float16'`)."
            )
        raise ExportError(
            f"ONNX Runtime could not {what} the ONNX graph of model "
            f"{model.name!r} ({onnx_path}) for the parity check: "
            f"{type(e).__name__}: {first}. {why} Or export without "
            "`verify_data` to write the file and inspect the node named "
            "above; report it with the model if it is a keras_mp export."
        ) from e


# ONNX Runtime 1.32's CPU graph optimizer (level EXTENDED) removes a Relu
# before a QuantizeLinear as if its zero point clipped at 0, which holds
# for INT8/UINT8 codes and not for FP8 (measured: tests/onnx/test_fp8.py).
FP8_OPTIMIZED_NOTE = (
    "FP8 graph: ONNX Runtime's CPU optimizer drops a Relu before an FP8 "
    "QuantizeLinear, so its optimized figure is not the graph's; TensorRT "
    "is not affected"
)


def _optimized_note(proto):
    """Why the default-optimized figures of this graph mislead, or ""."""
    graph = proto.graph
    fp8 = {i.name for i in graph.initializer if i.data_type == FLOAT8E4M3FN}
    if any(
        n.op_type == "QuantizeLinear" and n.input[2:3] and n.input[2] in fp8
        for n in graph.node
    ):
        return FP8_OPTIMIZED_NOTE
    return ""


def _graph_dtype(proto):
    """The 16-bit type of a strongly typed export (`export_onnx(dtype=...)`,
    read from the file's metadata), else "float32"."""
    from keras_mp.onnx.islands import typed_graph

    typed = typed_graph(proto)
    return typed.dtype if typed is not None else "float32"


def check_parity(
    model, onnx_path, data, min_top1_agreement, max_rel_l2, serve=None
):
    """`verify_onnx`, with the traced `serve` function of an export (which
    spares a second trace of `model`) when it computes what `model` does."""
    check_tolerances(min_top1_agreement, max_rel_l2)
    inputs = verify_inputs(model, data)
    if not os.path.isfile(onnx_path):
        raise FileNotFoundError(f"ONNX file not found: {onnx_path}")
    want, names = _keras_outputs(model, inputs, serve)
    proto = optional_import("onnx").load(onnx_path)
    dtype = _graph_dtype(proto)
    reference = reference_only(proto)
    with _ort_errors(model, onnx_path, "load"):
        session = (
            ReferenceSession(onnx_path)
            if reference
            else ort_session(onnx_path, optimized=False)
        )
    if len(session.get_outputs()) != len(want):
        raise ExportError(
            f"{onnx_path} has {len(session.get_outputs())} output(s), but "
            f"model {model.name!r} has {len(want)} ({names}): is this the "
            "file exported from this model?"
        )
    with _ort_errors(model, onnx_path, "run"):
        rows = _compare(want, run_session(session, inputs), names, dtype)
    note = _optimized_note(proto)
    if reference:
        note, optimized = REFERENCE_NOTE, None
    elif note:  # ORT's optimizer mishandles FP8: its figures are a note only
        try:
            optimized = _compare(
                want, run_session(ort_session(onnx_path), inputs), names, dtype
            )
        except Exception as e:  # noqa: BLE001 - an ORT optimizer crash
            optimized = None
            note += f"; here it fails ({str(e).splitlines()[0][:160]})"
    else:
        with _ort_errors(model, onnx_path, "optimize and run"):
            optimized = _compare(
                want, run_session(ort_session(onnx_path), inputs), names, dtype
            )
    report = ParityReport(
        len(inputs[0]),
        min(r.top1_agreement for r in rows),
        max(r.max_abs_diff for r in rows),
        max(r.mean_abs_diff for r in rows),
        max(r.rel_l2 for r in rows),
        min(r.top1_agreement for r in optimized) if optimized else None,
        max(r.rel_l2 for r in optimized) if optimized else None,
        rows=rows,
        note=note,
        near_ties=sum(r.near_ties for r in rows),
        dtype=dtype,
        runtime="onnx.reference" if reference else "ONNX Runtime",
    )
    if report.top1_agreement < min_top1_agreement or report.rel_l2 > max_rel_l2:
        raise ParityError(
            f"{report}. Tolerance: top-1 agreement >= "
            f"{100 * min_top1_agreement:.2f}% and relative L2 <= {max_rel_l2}."
        )
    return report


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
            list of arrays in `model.inputs` order or a dict by input name
            (a model built from a dict takes either). Each array must fit
            its input's dtype: integer inputs (token ids, masks) take
            integer arrays, never floats.
        min_top1_agreement: float in [0, 1]. Fail below this fraction of
            agreeing top-1 predictions. Near-ties are not counted: a
            prediction whose Keras top-1 margin is within the expected
            numeric error of the graph's float type (64 unit roundoffs of
            its largest |logit|: about 3e-2 of it in a float16 graph, 4e-6
            in float32) may go either way; the report says how many there
            were (`near_ties`). Defaults to 0.999.
        max_rel_l2: float, positive. Fail above this relative L2 difference
            of the outputs. Defaults to 0.01.

    Returns:
        `ParityReport`.

    Raises:
        ValueError: `min_top1_agreement` outside [0, 1] (99.9 is a
            percentage: pass 0.999) or `max_rel_l2` not positive and
            finite.
        ExportError: the model was never called, or `data` does not fit
            its inputs (a missing or extra dict key, a wrong count, shape
            or dtype).
        FileNotFoundError: no file at `onnx_path`.
        ParityError: past a tolerance.

    Example:

    >>> keras_mp.verify_onnx(qmodel, "model.onnx", x_test[:1000])
    """
    return check_parity(model, onnx_path, data, min_top1_agreement, max_rel_l2)

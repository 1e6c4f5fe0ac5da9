"""Keras vs ONNX Runtime on the same inputs: `verify_onnx`, and the ONNX
Runtime session helpers the demo's latency figures use too."""

import dataclasses
import os

import numpy as np

from keras_mp._compat import optional_import
from keras_mp.onnx.errors import ExportError, ParityError


@dataclasses.dataclass
class ParityReport:
    """Keras vs ONNX Runtime on the same inputs."""

    samples: int
    top1_agreement: float
    max_abs_diff: float
    mean_abs_diff: float
    rel_l2: float
    optimized_top1_agreement: float = None
    optimized_rel_l2: float = None

    def __str__(self):
        text = (
            f"ONNX Runtime parity on {self.samples} inputs (graph "
            f"optimizations off): top-1 agreement "
            f"{100 * self.top1_agreement:.2f}%, relative L2 {self.rel_l2:.2e}, "
            f"max |diff| {self.max_abs_diff:.3g}, mean |diff| "
            f"{self.mean_abs_diff:.3g}"
        )
        if self.optimized_top1_agreement is not None:
            text += (
                f"; with ORT's default optimizations: top-1 agreement "
                f"{100 * self.optimized_top1_agreement:.2f}%, relative L2 "
                f"{self.optimized_rel_l2:.2e}"
            )
        return text


def ort_session(path, optimized=True):
    """An ONNX Runtime CPU session on the file at `path`.

    Args:
        path: str. The `.onnx` file.
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
        str(path), options, providers=["CPUExecutionProvider"]
    )


def run_session(session, inputs, batch_size=512):
    """Runs `session` on `inputs` in batches.

    Args:
        session: an `onnxruntime.InferenceSession`.
        inputs: list of NumPy arrays, one per graph input, in order.
        batch_size: int. Defaults to 512.

    Returns:
        The list of outputs, each concatenated over the batches.
    """
    names = [i.name for i in session.get_inputs()]
    batches = [
        session.run(
            None,
            {name: x[i : i + batch_size] for name, x in zip(names, inputs)},
        )
        for i in range(0, len(inputs[0]), batch_size)
    ]
    return [np.concatenate(outs) for outs in zip(*batches)]


def _verify_inputs(model, data):
    """`data` as a list of float32 arrays, one per model input, checked."""
    specs = list(model.inputs)
    if isinstance(data, dict):
        names = [t.name for t in specs]
        missing = [n for n in names if n not in data]
        if missing:
            raise ExportError(
                f"`verify_data` has keys {sorted(data)}, but model "
                f"{model.name!r} has inputs {names}: give one array per input."
            )
        data = [data[n] for n in names]
    elif not isinstance(data, (list, tuple)):
        data = [data]
    if len(data) != len(specs):
        raise ExportError(
            f"`verify_data` holds {len(data)} array(s), but model "
            f"{model.name!r} has {len(specs)} input(s): pass a list (or a dict "
            "by input name) with one array per input."
        )
    arrays = []
    for spec, x in zip(specs, data):
        x = np.asarray(x, np.float32)
        if x.ndim == 0 or len(x) == 0:
            raise ExportError("`verify_data` is empty: pass some real inputs.")
        expected = tuple(spec.shape[1:])
        if x.shape[1:] != expected:
            raise ExportError(
                f"`verify_data` has shape {x.shape}, but model {model.name!r} "
                f"expects (batch,) + {expected}. Pass inputs shaped like the "
                "model's."
            )
        arrays.append(x)
    if len({len(x) for x in arrays}) > 1:
        raise ExportError(
            "`verify_data` arrays have different batch sizes "
            f"{[len(x) for x in arrays]}: give every input the same number "
            "of samples."
        )
    return arrays


def _compare(want, got):
    """(top-1 agreement, max |diff|, mean |diff|, relative L2), worst over
    the outputs; top-1 on the outputs with a class axis."""
    agree, max_diff, mean_diff, rel = 1.0, 0.0, 0.0, 0.0
    for w, g in zip(want, got):
        diff = np.abs(w - g)
        if w.ndim >= 2 and w.shape[-1] > 1:
            agree = min(agree, float(np.mean(w.argmax(-1) == g.argmax(-1))))
        max_diff = max(max_diff, float(diff.max()))
        mean_diff = max(mean_diff, float(diff.mean()))
        norm = max(float(np.linalg.norm(w)), 1e-12)
        rel = max(rel, float(np.linalg.norm(w - g)) / norm)
    return agree, max_diff, mean_diff, rel


def _keras_outputs(model, inputs, serve=None, batch_size=512):
    """The model's float32 outputs on `inputs`: through `serve` (the
    function export_onnx already traced, so no second trace) or
    `model.predict`."""
    if serve is None:
        want = model.predict(
            inputs if len(inputs) > 1 else inputs[0],
            batch_size=batch_size,
            verbose=0,
        )
        want = want if isinstance(want, (list, tuple)) else [want]
        return [np.asarray(w, np.float32) for w in want]
    chunks = [
        serve(*[a[i : i + batch_size] for a in inputs])
        for i in range(0, len(inputs[0]), batch_size)
    ]
    return [
        np.concatenate([np.asarray(c[k], np.float32) for c in chunks])
        for k in range(len(chunks[0]))
    ]


def check_parity(
    model, onnx_path, data, min_top1_agreement, max_rel_l2, serve=None
):
    """`verify_onnx`, with the traced `serve` function of an export (which
    spares a second trace of `model`) when it computes what `model` does."""
    inputs = _verify_inputs(model, data)
    if not os.path.isfile(onnx_path):
        raise FileNotFoundError(f"ONNX file not found: {onnx_path}")
    want = _keras_outputs(model, inputs, serve)
    got = run_session(ort_session(onnx_path, optimized=False), inputs)
    agree, max_diff, mean_diff, rel = _compare(want, got)
    opt_agree, _, _, opt_rel = _compare(
        want, run_session(ort_session(onnx_path), inputs)
    )
    report = ParityReport(
        len(inputs[0]), agree, max_diff, mean_diff, rel, opt_agree, opt_rel
    )
    if agree < min_top1_agreement or rel > max_rel_l2:
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
            list of arrays in `model.inputs` order or a dict by input name.
        min_top1_agreement: float. Fail below this. Defaults to 0.999.
        max_rel_l2: float. Fail above this relative L2 difference of the
            outputs. Defaults to 0.01.

    Returns:
        `ParityReport`.

    Raises:
        ExportError: `data` does not fit the model's inputs.
        FileNotFoundError: no file at `onnx_path`.
        ParityError: past a tolerance.

    Example:

    >>> keras_mp.verify_onnx(qmodel, "model.onnx", x_test[:1000])
    """
    return check_parity(model, onnx_path, data, min_top1_agreement, max_rel_l2)

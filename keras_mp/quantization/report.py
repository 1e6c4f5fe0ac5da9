"""`quantization_report`: what is quantized in a model, with which ranges."""

import dataclasses
import warnings

import keras
import numpy as np

from keras_mp import _keras, _models, _record, layer_table
from keras_mp.layer_table import NO_INPUTS, SKIP_INPUTS
from keras_mp.quantization import placement, twins
from keras_mp.quantization.activation import quantizable_row
from keras_mp.quantization.legacy import check_current
from keras_mp.quantization.tensor_quantizer import TensorQuantizer


def _quantized_row(layer):
    """A quantized layer's row."""
    kind = _models.class_name(layer)
    named = {
        int(k[6:]) if k.startswith("input_") and k[6:].isdigit() else k: q
        for k, q in layer.named_quantizers().items()
    }
    amaxes = {k: float(q.amax.numpy()) for k, q in named.items()}
    uncalibrated = any(a == 0 for a in amaxes.values())
    notes = []
    fmt, why = placement.layer_format(layer, layer.quantize_config)
    if why:
        notes.append(why)
    if uncalibrated:
        notes.append("uncalibrated input range (0): run keras_mp.calibrate")
    if _is_vector_dot(layer):
        notes.append(VECTOR_DOT_NOTE)
    role = placement.qdq_role(layer)
    if role and layer.input_quantizers:
        notes.append(placement.ROLE_NOTES[role])
    if layer.quantize_calls > 1 and named:
        notes.append(
            f"shared: called {layer.quantize_calls} times, one input range "
            "covers every call"
        )
    return {
        "type": kind,
        "quantized": True,
        "format": fmt,
        "inputs": amaxes,
        "weights": {
            attr: (float(np.min(v.numpy())), float(np.max(v.numpy())))
            for attr, v in [
                *((attr, v) for attr, _, v in layer.weight_ranges),
                *((k, q.amax) for k, q, w in layer.site_quantizers() if w),
            ]
        },
        "block_size": next(
            (q.block_size for q in layer.weight_quantizers if q.block_size),
            None,
        ),
        "note": "; ".join(notes),
    }


# TensorRT's ONNX importer builds an ONNX LSTM/GRU/RNN op's matmuls from
# its float inputs, inside a loop it makes itself (onnx-tensorrt
# `onnxOpImporters.cpp`; docs/operators.md lists FP32/FP16/BF16 only): no
# Q/DQ reaches them, so recurrent layers stay float, and so does the Loop
# body tf2onnx writes for cells it does not recognize (`docs/export.md`).
RECURRENT_NOTE = (
    "recurrent: runs in float (TensorRT builds an ONNX LSTM/GRU/RNN op's "
    "matmuls from float inputs only; the Loop tf2onnx makes of other cells "
    "gets no Q/DQ)"
)
_RECURRENT = (
    keras.layers.RNN,
    keras.layers.Bidirectional,
    keras.layers.LSTMCell,
    keras.layers.GRUCell,
    keras.layers.SimpleRNNCell,
)


# ModelOpt's ONNX PTQ (`find_nodes_from_matmul_to_exclude` in
# `modelopt/onnx/quantization/graph_selection.py`) leaves a MatMul of two
# activations float when its output has a dimension of 1 (a GEMV, no Tensor
# Core kernel): a Dot of two vectors is one (`docs/quantization.md`).
VECTOR_DOT_NOTE = (
    "a dot of two vectors (a GEMV): ModelOpt's ONNX PTQ keeps such MatMuls "
    "float; QuantizeConfig(dot=False) does too"
)


def _is_vector_dot(layer):
    """Whether a quantized `layer` is a Dot of two rank-2 inputs."""
    row = quantizable_row(layer)
    if row is None or not row.matmul or not layer.op_quantizers:
        return False
    shapes = (layer.get_build_config() or {}).get("input_shape") or ()
    return len(shapes) == 2 and all(len(s) == 2 for s in shapes)


def _float_note(layer):
    if isinstance(layer, _RECURRENT):
        return RECURRENT_NOTE
    attention = layer_table.float_attention_note(layer)
    if attention:
        return attention
    known = layer_table.row_for(layer) is not None
    row = quantizable_row(layer)
    if not known and _keras.sublayers(layer):
        return "holds layers: they are listed on their own rows"
    if not known and _keras.own_variables(layer):
        return (
            "not a quantizable type (not in the layer table), with weights "
            "of its own: runs in float"
        )
    if row is None:
        return "not a quantizable type: runs in float"
    small = placement.small_gemm(layer)
    if small:
        return small
    if row.matmul:
        return (
            "matmul of two activations runs in float: not selected, or "
            "QuantizeConfig(dot=False)"
        )
    if not row.weights and row.inputs == NO_INPUTS:
        return "no Q/DQ needed (TensorRT propagates scales)"
    if not row.weights and row.inputs == SKIP_INPUTS:
        return (
            "residual Add with no input TensorRT fuses from a weighted layer "
            "without activation: no Q/DQ (quantize_inputs=True forces them)"
        )
    return "not selected, or skipped by QuantizeConfig"


def _cells(row):
    """(flag, path, type, format, input ranges, weight ranges, note) of a
    report row, as the table prints them."""
    ins = ", ".join(f"in{i}={a:.4g}" for i, a in row["inputs"].items())
    ws = ", ".join(
        f"{k}=[{lo:.3g}..{hi:.3g}]" for k, (lo, hi) in row["weights"].items()
    )
    flag = "Q" if row["quantized"] else "-"
    fmt = row.get("format", "")
    if row.get("block_size"):
        fmt += f"/{row['block_size']}"  # values per block along K
    return flag, row["path"], row["type"], fmt, ins, ws, row["note"]


@dataclasses.dataclass
class QuantizationReport:
    """What `quantization_report` found: one row per layer.

    `print(report)` shows one line per layer (`Q` for a quantized one,
    `-` for one that runs in float, and why), `report.to_markdown()` the
    same as a Markdown table, `report.to_dict()` the rows as plain Python.

    Attributes:
        rows: list of dict, one per layer in the model's order (the layers
            inside a nested model or custom layer after it): `layer` (its
            name), `path` (the names from the model down to it), `type`,
            `quantized` (bool), `inputs` (activation ranges by input
            index, or by name: `pointwise_input`, `input_query`,
            `attention_probs`, ...), `weights` (per-channel range min/max
            by weight), `format` (a quantized layer's number format:
            `"int8"`, `"float8"`, `"int4"`, ...), `block_size` (values per
            block of a block-scaled weight, else None), `note`.

    Until the next release the report also reads as the list of rows it
    replaces (`for row in report`, `report[0]`, `len(report)`), with a
    `DeprecationWarning` naming `report.rows`.

    Example:

    >>> report = keras_mp.quantization_report(qmodel, verbose=False)
    >>> [r["path"] for r in report.rows if r["quantized"]]
    >>> print(report.to_markdown())
    """

    rows: list

    def to_dict(self):
        """The report as plain Python (JSON-ready): `{"rows": [...]}`, a
        weight's range as a `[min, max]` list."""
        return {
            "rows": [
                dict(
                    r,
                    inputs=dict(r["inputs"]),
                    weights={k: list(v) for k, v in r["weights"].items()},
                )
                for r in self.rows
            ]
        }

    def to_markdown(self):
        """The report as a Markdown table, one line per layer."""
        lines = [
            "| | layer | type | format | input ranges | weight ranges | note |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            "| " + " | ".join(c.replace("|", "\\|") for c in _cells(r)) + " |"
            for r in self.rows
        ]
        return "\n".join(lines)

    def __str__(self):
        return "\n".join(
            f"{flag} {path:<24} {kind:<22} {fmt:<8} {ins} {ws} {note}"
            for flag, path, kind, fmt, ins, ws, note in map(_cells, self.rows)
        )

    # The list `quantization_report` returned before, for one release.
    def _rows_as_list(self):
        warnings.warn(
            "quantization_report returns a QuantizationReport: read its "
            "list of rows as `report.rows`. Iterating, indexing or len() "
            "of the report itself will stop working in the next release.",
            DeprecationWarning,
            stacklevel=3,
        )
        return self.rows

    def __iter__(self):
        return iter(self._rows_as_list())

    def __getitem__(self, index):
        return self._rows_as_list()[index]

    def __len__(self):
        return len(self._rows_as_list())


def quantization_report(model, verbose=True):
    """Per layer: what is quantized, with which ranges, what is skipped, why.

    Args:
        model: a `keras.Model`, quantized or not; nested models and the
            layers inside custom layers are listed layer by layer.
        verbose: bool. Print the table. Defaults to True.

    Returns:
        A `QuantizationReport`: `report.rows` holds one dict per layer
        (`layer`, `path`, `type`, `quantized`, `inputs`, `weights`,
        `format`, `block_size`, `note`), `print(report)` shows the table.

    Raises:
        TypeError: `model` is not a Keras 3 model.

    Example:

    >>> report = keras_mp.quantization_report(qmodel, verbose=False)
    >>> [r["layer"] for r in report.rows if r["quantized"]]
    """
    _models.check_model(model, "quantization_report")
    check_current(model, "quantization_report")
    rows = []
    root = _record.contents(model)
    for layer, parents in _models.walk_layers(root, with_parents=True):
        if isinstance(layer, keras.layers.InputLayer):
            continue
        path = _models.layer_path(layer, parents)
        row = {"layer": layer.name, "path": path, "type": type(layer).__name__}
        if twins.is_quantized(layer):
            row.update(_quantized_row(layer))
        elif isinstance(layer, TensorQuantizer):
            amax = float(np.max(layer.amax.numpy()))
            row.update(quantized=True, inputs={0: amax})
            row.update(weights={}, note="stand-alone Q/DQ")
        else:
            row.update(quantized=False, inputs={}, weights={})
            row["note"] = _float_note(layer)
        rows.append(row)
    report = QuantizationReport(rows)
    if verbose and rows:
        print(report)
    return report

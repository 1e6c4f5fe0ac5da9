"""Export to Q/DQ ONNX (through tf2onnx) and SavedModel, written
atomically and checked against Keras; `docs/export.md` explains each step.
"""

import os
import re
import warnings

import numpy as np

from keras_mp import _inputs
from keras_mp._compat import optional_import, require_tensorflow
from keras_mp._models import check_model
from keras_mp.io import atomic_path
from keras_mp.onnx import blocked, dynamic_blocks, retype
from keras_mp.onnx import fp16 as onnx_fp16
from keras_mp.onnx.convert import function_to_onnx
from keras_mp.onnx.errors import ExportError
from keras_mp.onnx.fold import fold_weight_qdq
from keras_mp.onnx.islands import MAX_MAGNITUDE, apply_islands
from keras_mp.onnx.parity import (
    check_parity,
    check_tolerances,
    flat_outputs,
    output_names,
    verify_inputs,
)
from keras_mp.onnx.twin import float32_twin, half_compute_dtype
from keras_mp.quantization.calibrate import activation_quantizers
from keras_mp.quantization.formats import onnx_trace
from keras_mp.quantization.twins import quantizers as quantizers_of

# tf2onnx 1.17 converts up to opset 18; later opsets go through ONNX's
# version converter.
_TF2ONNX_MAX_OPSET = 18
_NO_BFLOAT16_PARITY = (
    "dtype='bfloat16': parity not checked. ONNX Runtime's CPU provider has "
    "no bfloat16 kernels for Add, Mul, MatMul, Conv, Softmax and most other "
    "arithmetic (1.32 runs Cast, Transpose, Concat, Clip, Identity and "
    "LayerNormalization only), so this graph cannot run here. It was checked "
    "structurally (onnx.checker, strict shape inference, element types) and "
    "its float32 islands were measured on verify_data in float32; check "
    "parity on the target (TensorRT) or export dtype='float16' to run it in "
    "ONNX Runtime."
)


def _check_signature(model, what):
    """ExportError unless `model` has known symbolic inputs."""
    check_model(model, what)
    try:
        inputs = model.inputs if model.built else None
    except AttributeError:
        raise ExportError(
            f"Model {model.name!r} is a subclassed keras.Model: it has no "
            f"symbolic inputs, so {what} does not know its input signature. "
            "Wrap it in a functional model first: `x = keras.Input(shape); "
            "keras.Model(x, model(x))`."
        ) from None
    if not inputs:
        raise ExportError(
            f"Model {model.name!r} has never been called, so its input "
            "signature is unknown. Build it with `keras.Input(...)` or call it "
            "once on a batch before exporting."
        )


# Model files Keras writes: an ONNX graph under such a name would be taken
# for one (and `keras.saving.load_model` fails on it).
_KERAS_SUFFIXES = (".keras", ".h5", ".hdf5")


def _check_path(path, overwrite):
    """`path` as a str, or an ExportError when it cannot take the ONNX
    file: a directory, a Keras model file's name, an existing file without
    `overwrite`."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ExportError(
            f"`path` is a directory; export_onnx writes one file. Received: "
            f"path={path!r}. Pass a file name in it, e.g. "
            f"{os.path.join(path, 'model.onnx')!r}. Nothing was written."
        )
    if path.lower().endswith(_KERAS_SUFFIXES):
        stem = os.path.splitext(path)[0]
        raise ExportError(
            "export_onnx writes an ONNX graph, not a Keras model file. "
            f"Received: path={path!r}. Name it {stem + '.onnx'!r}; save the "
            "Keras model with `model.save('model.keras')`. Nothing was "
            "written."
        )
    if os.path.exists(path) and not overwrite:
        raise ExportError(
            f"{path} exists. Pass overwrite=True (CLI: --overwrite) to "
            "replace it."
        )
    return path


def _check_exportable(model):
    _check_signature(model, "export_onnx")
    quantizers = activation_quantizers(model, "export_onnx")
    problems = [
        name
        for name, q in quantizers.items()
        if not 0 < float(q.amax.numpy()) < np.inf
        # MXFP8 activations: scales from each block alone, no range
        and not (q.dynamic_blocks and not q.format.block_format.global_scale)
    ]
    if problems:
        raise ExportError(
            f"Uncalibrated (or collapsed, amax 0) or non-finite activation "
            f"ranges in {', '.join(problems)}: their scale would be 0, NaN "
            "or inf, which TensorRT rejects. Run keras_mp.calibrate(model, "
            "data) first (on finite data), or skip those layers with "
            "QuantizeConfig(skip=True)."
        )
    unwritable = sorted(
        f"{q.name} ({q.quantizer.format.name})"
        for q in quantizers_of(model, "export_onnx")
        if q.quantizer.format.onnx_type is None and not q.quantizer.block_size
    )
    if unwritable:
        raise ExportError(
            f"ONNX export writes INT8 Q/DQ (scale = amax / 127), but "
            f"{len(unwritable)} quantizer(s) of model {model.name!r} use "
            f"fewer bits: {', '.join(unwritable[:8])}"
            + (", ..." if len(unwritable) > 8 else "")
            + ". The file would not compute what the Keras model does. "
            "Quantize with QuantizeConfig(precision='int8') to export; "
            "fewer bits are for simulation in Keras only. Nothing was "
            "written."
        )


def _trace(model):
    """A `tf.function` serving `model`: one argument per model input, named
    after it and of its dtype; float outputs as float32, flattened (dict
    outputs by sorted key). Its `output_names` attribute names them."""
    import tensorflow as tf

    specs = _inputs.input_specs(model, "export_onnx", ExportError)
    signature = [
        tf.TensorSpec((None,) + s.shape[1:], s.dtype, name=s.name)
        for s in specs
    ]
    names = []

    @tf.function(input_signature=signature)
    def serve(*inputs):
        out = model(_inputs.call_arg(model, inputs, specs), training=False)
        names[:] = output_names(out, model)
        return [
            tf.cast(o, tf.float32) if o.dtype.is_floating else o
            for o in flat_outputs(out)
        ]

    try:
        serve.get_concrete_function()
    except TypeError as e:
        dynamic = [s.name for s in specs if None in s.shape[1:]]
        if not dynamic or "cannot be interpreted as an integer" not in str(e):
            raise
        where = re.search(r"when calling (\S+)\(\)", str(e))
        raise ExportError(
            f"Tracing model {model.name!r} failed"
            f"{f' in {where.group(1)}()' if where else ''}: its code needs "
            "a fixed size (a Python loop over a dimension, for example the "
            f"sequence length) that input(s) {', '.join(dynamic)} leave "
            "dynamic (None). Export a model built for the size it will run "
            "at: `keras.Model(inputs, model(inputs))` with `inputs` "
            "`keras.Input` of fixed shapes. Nothing was written."
        ) from e
    serve.output_names = names
    return serve


def export_onnx(
    model,
    path,
    opset=None,
    inputs_as_nchw=None,
    verify_data=None,
    overwrite=False,
    min_top1_agreement=None,
    max_rel_l2=None,
    fp16=False,
    allow_lint_violations=False,
    dtype=None,
    max_magnitude=MAX_MAGNITUDE,
):
    """Exports a Keras model to ONNX with TensorRT-style Q/DQ.

    Works for float, mixed-precision and quantized models. A model whose
    layers compute in float16 or bfloat16 is exported through a float32
    twin (`keras_mp.onnx.twin.float32_twin`), so the graph is float32 at
    its boundaries and between its Q/DQ pairs. `dtype="float16"` or
    `"bfloat16"` writes a strongly typed graph (TensorRT 11 takes every
    tensor's type from the file): 16-bit where safe, float32 islands where
    not. Parity is checked against that twin, whose numerics the
    graph implements: the 16-bit model's own rounding is not an export
    error (`docs/export.md` has how far the two are apart).

    The file is written to a temporary path, verified when `verify_data`
    is given, then renamed: a failure leaves no partial file and any
    previous file intact.

    Args:
        model: a called `keras.Model`.
        path: str. The `.onnx` file to write.
        opset: int. ONNX opset, >= 13 (per-channel Q/DQ). Defaults to 17,
            19 with a 16-bit `dtype` or FP8 quantizers (FP8 Q/DQ need 19),
            21 with INT4 weights (blocked DequantizeLinear), 23 with NVFP4
            (FLOAT4E2M1), 24 with MXFP8 (FLOAT8E8M0 scales); an explicit
            lower opset is an error. ONNX Runtime cannot run NVFP4 or
            MXFP8: their parity is checked with `onnx.reference`.
        inputs_as_nchw: list of input names to expose as NCHW. Defaults to
            None (NHWC, as the Keras model).
        verify_data: what the model takes (one array; a list, or a dict by
            input name, for several inputs; a tf.data.Dataset or iterable
            of such batches, labels ignored). When given, compare ONNX
            Runtime with Keras on it, output by output (see `verify_onnx`),
            before the file lands.
        overwrite: bool. Replace an existing file. Defaults to False.
        min_top1_agreement: float in [0, 1]. Parity tolerance: the
            fraction of top-1 predictions that must agree, near-ties (a
            Keras top-1 margin within the graph type's expected error) not
            counted (see `verify_onnx`). Defaults to 0.999, or 0.99 with a
            16-bit `dtype`.
        max_rel_l2: float, positive. Parity tolerance. Defaults to 0.01, or
            0.05 with a 16-bit `dtype` (float16 arithmetic and float16
            scales move the logits by about 1% against the float32 Keras
            model), or 0.25 (and `min_top1_agreement` 0.8) for a model
            with NVFP4 inputs: they read 16-bit values, and one float16
            rounding at a boundary of E2M1's coarse levels moves a value a
            whole step (`dynamic_blocks.NVFP4_INPUT_MAX_REL_L2`).
        fp16: bool. Deprecated alias of `dtype="float16"` (a
            `DeprecationWarning`). Defaults to False.
        allow_lint_violations: bool. For a model keras_mp quantized
            (`quantize_model`), a graph that breaks the TensorRT contract
            (`check_tensorrt`) raises an ExportError; True writes it with a
            warning instead. Graphs keras_mp did not quantize (float
            models, Keras' own `model.quantize`) only ever warn. Defaults
            to False.
        dtype: str. `"float16"` or `"bfloat16"`: a strongly typed graph
            (needs opset >= 19). Everything that is not INT8 is written in
            that type (Q/DQ scales included, so each DequantizeLinear
            outputs it), except float32 islands: the layers the Keras
            policy computes in float32 (softmax, normalization but
            BatchNorm, the output layers), nodes whose values on
            `verify_data` exceed `max_magnitude`, inputs ONNX requires in
            float32, and the Q/DQ pairs and Conv/MatMul tied to those. A
            Cast goes only at island boundaries, never between a
            DequantizeLinear and its Conv/MatMul; inputs and outputs stay
            float32. Each float32 node's reason is in its `doc_string`,
            the list in the file (`keras_mp.typed_graph(path)`) and on the
            returned report's `typed`. A float16 scale below float16's
            smallest normal number is raised to it, with one
            `UserWarning` naming each Keras quantizer and what its INT8
            grid loses. ONNX Runtime's CPU provider has no bfloat16
            arithmetic kernels, so a bfloat16 graph's parity is not
            checked (a `UserWarning` says so). `None` or `"float32"`:
            float32. Defaults to None.
        max_magnitude: float. With a 16-bit `dtype`, a node whose float
            inputs or outputs exceed this on `verify_data` (its first 64
            rows, run in float32) stays float32. Defaults to 512,
            ModelOpt AutoCast's `data_max`.

    The ONNX graph has one input per model input, named after the Keras
    input and of its dtype (int32 token ids stay int32), and one output
    per model output (a dict's by sorted key).

    Returns:
        `ParityReport` when `verify_data` was given, else None.

    Raises:
        ValueError: `min_top1_agreement` outside [0, 1] or `max_rel_l2`
            not positive and finite.
        ExportError: not exportable (never called, uncalibrated ranges,
            opset < 13, existing file without `overwrite`, `path` a
            directory or a `.keras`/`.h5` name, an op tf2onnx
            cannot convert, `verify_data` that does not fit the inputs, a
            TensorRT contract violation in a graph keras_mp quantized; a
            `dtype` other than float32, float16 or bfloat16, or `fp16=True`
            with another `dtype`; with float16, a Q/DQ scale that is not
            positive and finite).
        ParityError: ONNX Runtime disagrees with Keras past the tolerance.

    Example:

    >>> keras_mp.export_onnx(qmodel, "model.onnx", verify_data=x_test[:1000])
    """
    require_tensorflow("keras_mp.export_onnx")
    optional_import("tf2onnx")
    onnx = optional_import("onnx")
    opset_given = opset is not None
    dtype = onnx_fp16.resolve_dtype(dtype, fp16, ExportError)
    if opset is None:
        opset = onnx_fp16.MIN_OPSET if dtype else 17
    if not isinstance(opset, int) or opset < 13:
        raise ExportError(
            f"Per-channel Q/DQ needs opset >= 13. Received: opset={opset!r}"
        )
    if opset > onnx.defs.onnx_opset_version():
        raise ExportError(
            f"onnx {onnx.__version__} knows opsets up to "
            f"{onnx.defs.onnx_opset_version()}. Received: opset={opset}"
        )
    if dtype and opset < onnx_fp16.MIN_OPSET:
        raise ExportError(
            f"dtype={dtype!r} stores Q/DQ scales in {dtype}, which needs "
            "opset >= "
            f"{onnx_fp16.MIN_OPSET}. Received: opset={opset}. Pass "
            f"opset={onnx_fp16.MIN_OPSET}."
        )
    nvfp4 = dtype and dynamic_blocks.has_nvfp4_inputs(model)
    if max_rel_l2 is None:
        max_rel_l2 = 0.05 if dtype else 0.01
        if nvfp4:
            max_rel_l2 = dynamic_blocks.NVFP4_INPUT_MAX_REL_L2
    if min_top1_agreement is None:
        min_top1_agreement = 0.99 if dtype else 0.999
        if nvfp4:
            min_top1_agreement = dynamic_blocks.NVFP4_INPUT_MIN_TOP1
    check_tolerances(min_top1_agreement, max_rel_l2)
    path = _check_path(path, overwrite)
    _check_exportable(model)
    dynamic_blocks.check_dtype(model, dtype)
    if verify_data is not None:
        verify_data = verify_inputs(model, verify_data)
    traced = float32_twin(model) if half_compute_dtype(model) else model
    serve = _trace(traced)
    carried, blocked_opset = retype.min_opset(traced), blocked.min_opset(traced)
    dynamic = dynamic_blocks.min_opset(traced)
    blocked_opset = max(blocked_opset, dynamic)
    needed = max(carried, blocked_opset)
    if needed > opset:
        kinds = " and ".join(
            kind
            for kind, n in (("FP8", carried), ("block-scaled", blocked_opset))
            if n
        )
        if opset_given:
            raise ExportError(
                f"Model {model.name!r} has {kinds} quantizers, whose Q/DQ "
                f"need opset >= {needed}. Received: opset={opset}. Pass "
                f"opset={needed} or leave it out. Nothing was written."
            )
        warnings.warn(
            f"Model {model.name!r} has {kinds} quantizers: exported at "
            f"opset {needed} (their Q/DQ need it) instead of {opset}.",
            stacklevel=2,
        )
        opset = needed
    exported = serve
    if needed:
        # a second trace in which FP8 quantizers write carriers tf2onnx
        # converts, and block-scaled weights stay float (`blocked.py`);
        # `serve` (the real rounding) stays for parity
        with onnx_trace(), dynamic_blocks.markers(traced):
            exported = _trace(traced)
    proto = function_to_onnx(
        exported,
        model,
        opset=min(opset, _TF2ONNX_MAX_OPSET),
        inputs_as_nchw=inputs_as_nchw,
    )
    if carried or dynamic:  # FP8 Q/DQ exist from opset 19
        proto = onnx_fp16.convert_version(proto, opset)
    if dynamic:  # NVFP4/MXFP8 activations: TensorRT's DynamicQuantize
        dynamic_blocks.write_dynamic_quantizers(proto, traced, dtype)
    if carried:  # retype, then fold
        retype.retype_carriers(proto, traced)
    proto = fold_weight_qdq(proto)
    proto = onnx_fp16.convert_version(proto, opset)
    if blocked_opset:  # blocked DQ (`block_size`) exist from opset 21
        blocked.write_blocked_weights(proto, traced)
    typed = None
    if dtype:
        try:
            proto, typed = apply_islands(
                proto, model, traced, dtype, verify_data, max_magnitude
            )
        except ValueError as e:
            raise ExportError(str(e)) from e
        if dtype == "bfloat16" and verify_data is not None:
            verify_data = None
            warnings.warn(_NO_BFLOAT16_PARITY, UserWarning, stacklevel=2)
    onnx.checker.check_model(proto)
    _check_tensorrt_contract(model, proto, allow_lint_violations)
    report = None
    with atomic_path(path) as tmp:
        onnx.save(proto, tmp)
        if verify_data is not None:
            report = check_parity(
                traced,
                tmp,
                verify_data,
                min_top1_agreement,
                max_rel_l2,
                serve=serve,
            )
            report.typed = typed
    return report


def _quantized_by_keras_mp(model):
    return bool(quantizers_of(model, "export_onnx"))


def _check_tensorrt_contract(model, proto, allow_lint_violations):
    """`check_tensorrt` on the graph before it is written: an ExportError
    when keras_mp placed the Q/DQ itself (a violation is then a bug in the
    export, not in the model), unless `allow_lint_violations`; a warning for
    graphs it did not quantize (float models, Keras' `model.quantize`), and
    for a quantized model whose graph leaves weighted ops in float."""
    from keras_mp.onnx.tensorrt import check_tensorrt

    lint = check_tensorrt(proto, check_sparsity=False)
    if lint.ok:
        left = [f for f in lint.warnings if f.rule == "float_weighted_ops"]
        if left and _quantized_by_keras_mp(model):
            warnings.warn(
                f"Model {model.name!r} is quantized, but in its ONNX graph "
                f"{left[0].message}",
                UserWarning,
                stacklevel=3,
            )
        return
    rules = sorted({f.rule for f in lint.violations})
    nodes = [f"{f.node} ({f.rule})" for f in lint.violations[:10]]
    more = (
        f" and {len(lint.violations) - 10} more"
        if len(lint.violations) > 10
        else ""
    )
    summary = (
        f"The ONNX graph of model {model.name!r} breaks the TensorRT "
        f"explicit-quantization contract ({len(lint.violations)} "
        f"violation(s) of {', '.join(rules)}: {'; '.join(nodes)}{more}); "
        "TensorRT will not build it as INT8."
    )
    if _quantized_by_keras_mp(model):
        if allow_lint_violations:
            warnings.warn(summary, UserWarning, stacklevel=3)
            return
        raise ExportError(
            f"{summary} The model has keras_mp quantize layers, so this "
            "graph is meant for a TensorRT INT8 build and would not get one. "
            "If some layers were quantized with Keras' own "
            "`layer.quantize(...)`, leave them float and let "
            "`keras_mp.quantize_model` quantize them; otherwise this is an "
            "export fault to report with the model. Nothing was written. "
            "Pass allow_lint_violations=True to write the file anyway (with "
            "a warning), e.g. to inspect it with `keras_mp.check_tensorrt`."
        )
    warnings.warn(
        f"{summary} If the model was quantized with Keras' own "
        "`model.quantize(...)`, quantize the float model with "
        "`keras_mp.quantize_model` instead. Run `keras_mp.check_tensorrt` "
        "on the file for the per-node list.",
        UserWarning,
        stacklevel=3,
    )


def export_saved_model(model, path, overwrite=False, verify_data=None):
    """Exports a serving SavedModel (`serve` endpoint), atomically.

    Quantize wrappers stay (they are the numerics); training-only pieces
    do not reach the graph (`training=False`).

    Args:
        model: a called `keras.Model`.
        path: str. The SavedModel folder.
        overwrite: bool. Replace an existing folder. Defaults to False.
        verify_data: NumPy array. When given, reload and compare outputs.

    Returns:
        The max absolute difference on `verify_data`, or None.

    Raises:
        ExportError: the folder exists (without `overwrite`), or the model
            was never called.

    Example:

    >>> keras_mp.export_saved_model(qmodel, "served", verify_data=x[:32])
    """
    require_tensorflow("keras_mp.export_saved_model")
    import tensorflow as tf

    path = os.fspath(path)
    if os.path.exists(path) and not overwrite:
        raise ExportError(f"{path} exists. Pass overwrite=True to replace it.")
    try:
        _check_signature(model, "export_saved_model")
    except ExportError as e:
        if "never been called" in str(e):
            raise ExportError(
                f"Model {model.name!r} has never been called. Call it once "
                "first."
            ) from None
        raise
    diff = None
    with atomic_path(path, is_dir=True) as tmp:
        model.export(tmp, format="tf_saved_model", verbose=False)
        if verify_data is not None:
            loaded = tf.saved_model.load(tmp)
            data = np.asarray(verify_data, np.float32)
            got = loaded.serve(data)
            want = model.predict(data, verbose=0)
            diff = float(np.max(np.abs(np.asarray(got) - want)))
    return diff

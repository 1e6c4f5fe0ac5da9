"""The model zoo: float and INT8 ONNX export of every keras.applications
family and of keras-hub backbones built from a config.

Each `keras.applications` family that builds offline (`weights=None`) is
built at the smallest input it accepts, with 10 classes and pre-softmax
logits (`classifier_activation=None`: a random-weight network's softmax is
near uniform, so its top-1 says nothing). The keras-hub rows are small
backbones built from a config (no download): a BERT-style text encoder
(a dict of int32 token ids, segment ids and padding mask in, a dict of
sequence and pooled outputs out), a ViT and a ResNet of basic blocks; their
data matches their inputs (token ids within the vocabulary, zero past each
sequence's length; images). Every model gets BatchNorm statistics taken
from the calibration inputs (`refresh_batchnorm`: with the initial ones the
signal of a random MobileNet dies out to 1e-17), then:

- float: `keras_mp.export_onnx`, then `keras_mp.verify_onnx` on 8 random
  inputs (ONNX Runtime, graph optimizations off); goal: relative L2 of the
  outputs (the worst output of several) <= 1e-4. Beside it, the same
  model rebuilt with float64 policies and the same weights gives the
  exact result, and both Keras float32 and ONNX Runtime float32 are
  measured against it: on a deep random-weight network float32 itself
  (summation order, fused kernels) moves the outputs by about 1e-4, so a
  row whose ONNX Runtime is no further from float64 than 1.5x Keras
  float32 is "ok (float32 noise)": the export added no error of its own;
- INT8: `keras_mp.quantize_model` + `keras_mp.calibrate` (max) on 32 random
  inputs + `keras_mp.export_onnx` + `keras_mp.check_tensorrt`: lint
  verdict, Q/DQ nodes, and the weighted ops (Conv, ConvTranspose, MatMul,
  Gemm) with DequantizeLinear on both inputs out of all of them. The INT8
  relative L2 is information only: a random-weight deep network amplifies
  one-step rounding flips layer by layer (`docs/export.md`);
- ModelOpt (`--modelopt [VENV]`): NVIDIA ModelOpt's ONNX PTQ (int8, max
  calibration on the same 32 inputs) of the same float ONNX, in its own
  venv, linted and counted like ours: Q/DQ nodes and coverage side by
  side, and the economy goal (no more Q/DQ nodes than ModelOpt at equal or
  better coverage). `--modelopt-only` runs that pass alone and merges it
  into the last results; `--merge` merges any rows measured.

keras-hub is optional here: without it, a run that includes its rows stops
at once and says how to install it (`--only` runs the other rows).

A stage that fails is recorded with the first line of its error, and the
run goes on. `tests/onnx/test_zoo.py` runs the same measurement: a fast
subset in `make test`, the whole zoo marked slow.

    python benchmarks/bench_zoo.py [--quick] [--only NAME ...]
        [--modelopt [VENV]] [--modelopt-only] [--merge]
"""

import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_mp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import hub_models  # noqa: E402
from _common import (  # noqa: E402
    RESULTS,
    add_only,
    bench_parser,
    markdown_table,
    modelopt_versions,
    write_results,
)

# Where `bench_peers.py --setup` builds ModelOpt's environment.
MODELOPT_VENV = os.path.join(HERE, ".venv-modelopt")

FLOAT_MAX_REL_L2 = 1e-4
# ONNX Runtime float32 is as faithful as Keras float32 when its distance to
# the float64 result is at most this times Keras' own.
FLOAT32_NOISE_FACTOR = 1.5


def float_parity_verdict(row):
    """The float parity verdict of a zoo row: "ok" (ONNX Runtime within
    1e-4 of Keras), "ok (float32 noise)"
    (further, but no further from the float64 result than Keras float32
    is, times 1.5: both round a chaotic random-weight network apart), or
    None (a real gap, or the export failed)."""
    if row["float_error"] is not None:
        return None
    if row["float_rel_l2"] <= FLOAT_MAX_REL_L2:
        return "ok"
    keras64, onnx64 = row.get("keras_vs_float64"), row.get("onnx_vs_float64")
    if keras64 is not None and onnx64 is not None:
        if onnx64 <= max(FLOAT_MAX_REL_L2, FLOAT32_NOISE_FACTOR * keras64):
            return "ok (float32 noise)"
    return None


SAMPLES = 8
CALIBRATION = 32
# Issue 16's goal: this share of the weighted ops behind Q/DQ on every row.
COVERAGE_GOAL = 0.95


# keras-hub BERT-style encoder: vocabulary and sequence length.
VOCAB = hub_models.VOCAB
SEQ = hub_models.SEQ

# The paragraph the results page opens with.
INTRO = (
    "Every `keras.applications` family that builds offline, random weights, "
    "smallest input each accepts (32x32; InceptionV3 / InceptionResNetV2 "
    "75x75, Xception 71x71; NASNetMobile `include_top=False` + Dense(10)); "
    "and keras-hub backbones built from a config: `BertBackbone` (2 layers, "
    "hidden 32, vocabulary 100; a dict of int32 `token_ids`, `segment_ids`, "
    "`padding_mask` of length 16 in, `sequence_output` and `pooled_output` "
    "out; `_seq16`: the same backbone called on inputs of fixed length 16, "
    "as a classifier feeds it), `ViTBackbone` (32x32, patch 8, 2 layers, "
    "hidden 32), "
    "`ResNetBackbone` (basic blocks, stages of 64 and 128 filters), "
    "`GemmaBackbone` and `LlamaBackbone` (2 layers, hidden 32, 2 query "
    "heads sharing 1 key/value head; `token_ids` and `padding_mask` of "
    "length 16), `T5Backbone` (2 encoder and 2 decoder layers, hidden "
    "32, 2 heads of 16; encoder and decoder token ids and padding masks of "
    "length 16) and `DebertaV3Backbone` (2 layers, hidden 32, 2 heads, "
    "relative buckets 8; `token_ids` and `padding_mask` of length 16). "
    "Float: `export_onnx` then `verify_onnx` on 8 random inputs (goal: "
    "relative L2 <= 1e-4, the worst output of several; beside it, Keras "
    "float32 and ONNX Runtime float32 against the model computed in float64 "
    "with the same weights: 'ok (float32 noise)' when ONNX Runtime is no "
    "further from float64 than 1.5x Keras float32). INT8: "
    "`quantize_model` + `calibrate` + `export_onnx` + `check_tensorrt`. "
    "`--quick` runs the fast subset of `tests/onnx/test_zoo.py`."
)


PLACEMENT_INTRO = (
    "Q/DQ placement against NVIDIA ModelOpt: its ONNX PTQ "
    "(`python -m modelopt.onnx.quantization --quantize_mode=int8 "
    "--calibration_method=max --calibration_eps cpu --high_precision_dtype "
    "fp32`) of the float ONNX keras_mp exported, calibrated on the same "
    f"{CALIBRATION} inputs, linted and counted by `keras_mp.check_tensorrt` "
    "like ours. Coverage: Conv, ConvTranspose, MatMul and Gemm nodes with a "
    "DequantizeLinear on both inputs (attention matmuls count). Economy: no "
    "more Q/DQ nodes than ModelOpt at equal or better coverage "
    "(`--modelopt` runs this pass; `--modelopt-only --only NAME ...` reruns "
    "it alone and merges into the last results)."
)


def _images(shape):
    """A maker of `n` random images of `shape`, in [0, 1)."""

    def make(rng, n):
        return rng.random((n,) + shape, dtype=np.float32)

    return make


def _token_batch(rng, n):
    """`n` BERT inputs: a sentence pair of random length (2 to `SEQ`
    tokens) each, token ids in [1, `VOCAB`), segment 1 on the second half,
    zeros past the length in all three arrays."""
    lengths = rng.integers(2, SEQ + 1, n)[:, None]
    positions = np.arange(SEQ)[None, :]
    padding_mask = (positions < lengths).astype(np.int32)
    token_ids = rng.integers(1, VOCAB, (n, SEQ)).astype(np.int32)
    segment_ids = (positions >= lengths // 2).astype(np.int32)
    return {
        "token_ids": token_ids * padding_mask,
        "segment_ids": segment_ids * padding_mask,
        "padding_mask": padding_mask,
    }


def _app(name, shape, **kwargs):
    """A builder of `keras.applications.<name>` with a 10-way logits head."""

    def build():
        return getattr(keras.applications, name)(
            input_shape=shape,
            weights=None,
            classes=10,
            classifier_activation=None,
            **kwargs,
        )

    return build


def _nasnet_mobile():
    # With include_top, NASNetMobile insists on 224x224; without it 32x32
    # builds, so the head is added here.
    base = keras.applications.NASNetMobile(
        input_shape=(32, 32, 3), weights=None, include_top=False, pooling="avg"
    )
    return keras.Model(base.inputs, keras.layers.Dense(10)(base.outputs[0]))


def _bert_tiny_fixed():
    # The BERT row's backbone with inputs of length `SEQ` (its own are
    # (None,)), as a fixed-length classifier would feed it.
    backbone = hub_models.BACKBONES["BertBackbone"]()
    inputs = {
        key: keras.Input((SEQ,), dtype="int32", name=key)
        for key in ("token_ids", "segment_ids", "padding_mask")
    }
    return keras.Model(inputs, backbone(inputs))


def _lm_token_batch(rng, n):
    """`n` decoder-LM inputs (Gemma, Llama): `token_ids` in [1, `VOCAB`)
    and a `padding_mask` of a random length (2 to `SEQ` tokens) each."""
    batch = _token_batch(rng, n)
    return {k: batch[k] for k in ("token_ids", "padding_mask")}


def _t5_token_batch(rng, n):
    """`n` T5 inputs: encoder and decoder token ids and padding masks, as
    `_lm_token_batch` makes them."""
    encoder, decoder = _lm_token_batch(rng, n), _lm_token_batch(rng, n)
    return {
        "encoder_token_ids": encoder["token_ids"],
        "encoder_padding_mask": encoder["padding_mask"],
        "decoder_token_ids": decoder["token_ids"],
        "decoder_padding_mask": decoder["padding_mask"],
    }


# name -> (builder, maker of `n` inputs from a NumPy generator).
# Concatenation is in the slow zoo (DenseNet121, Inception, NASNet:
# 70-100 s each) and in the fast `concat_transpose` case of
# tests/onnx/test_export.py.
APPLICATIONS = {
    "ConvNeXtTiny": (_app("ConvNeXtTiny", (32, 32, 3)), _images((32, 32, 3))),
    "DenseNet121": (_app("DenseNet121", (32, 32, 3)), _images((32, 32, 3))),
    "EfficientNetB0": (
        _app("EfficientNetB0", (32, 32, 3)),
        _images((32, 32, 3)),
    ),
    "EfficientNetV2B0": (
        _app("EfficientNetV2B0", (32, 32, 3)),
        _images((32, 32, 3)),
    ),
    "InceptionV3": (_app("InceptionV3", (75, 75, 3)), _images((75, 75, 3))),
    "InceptionResNetV2": (
        _app("InceptionResNetV2", (75, 75, 3)),
        _images((75, 75, 3)),
    ),
    "MobileNet_0.25": (
        _app("MobileNet", (32, 32, 3), alpha=0.25),
        _images((32, 32, 3)),
    ),
    "MobileNetV2_0.35": (
        _app("MobileNetV2", (32, 32, 3), alpha=0.35),
        _images((32, 32, 3)),
    ),
    "MobileNetV3Small": (
        _app("MobileNetV3Small", (32, 32, 3)),
        _images((32, 32, 3)),
    ),
    "NASNetMobile": (_nasnet_mobile, _images((32, 32, 3))),
    "ResNet50": (_app("ResNet50", (32, 32, 3)), _images((32, 32, 3))),
    "ResNet50V2": (_app("ResNet50V2", (32, 32, 3)), _images((32, 32, 3))),
    "VGG16": (_app("VGG16", (32, 32, 3)), _images((32, 32, 3))),
    "Xception": (_app("Xception", (71, 71, 3)), _images((71, 71, 3))),
}
# keras-hub rows: the backbones of `hub_models` at its default size (2
# layers, hidden 32; ResNet of basic blocks, stages of 64 and 128 filters).
# Gemma scales the query before the first attention matmul, Llama the
# scores after it; T5 adds a relative position bias to the scores;
# DeBERTaV3 adds two position matmuls per layer.
HUB = {
    "BertBackbone_tiny": (hub_models.BACKBONES["BertBackbone"], _token_batch),
    "BertBackbone_tiny_seq16": (_bert_tiny_fixed, _token_batch),
    "ViTBackbone_tiny": (
        hub_models.BACKBONES["ViTBackbone"],
        _images((32, 32, 3)),
    ),
    "ResNetBackbone_basic": (
        hub_models.BACKBONES["ResNetBackbone"],
        _images((32, 32, 3)),
    ),
    "GemmaBackbone_tiny": (
        hub_models.BACKBONES["GemmaBackbone"],
        _lm_token_batch,
    ),
    "LlamaBackbone_tiny": (
        hub_models.BACKBONES["LlamaBackbone"],
        _lm_token_batch,
    ),
    "T5Backbone_tiny": (hub_models.BACKBONES["T5Backbone"], _t5_token_batch),
    "DebertaV3Backbone_tiny": (
        hub_models.BACKBONES["DebertaV3Backbone"],
        _lm_token_batch,
    ),
}
ZOO = {**APPLICATIONS, **HUB}
# The fast subset: depthwise convolutions and residual Adds (MobileNetV2),
# squeeze-excite Multiplies and hard-swish (MobileNetV3), about 10-20 s
# each on 2 cores; a dict of int32 inputs and a dict of outputs through
# attention, LayerNorm and embeddings (BERT), patches and a class token
# (ViT), a few seconds each.
# MobileNetV2 0.35 is exported in the fast tests by
# tests/onnx/test_mixed_precision_export.py (mixed-precision QAT, float32
# and fp16 graphs), so the fast subset here leaves it to the slow zoo.
QUICK = [
    "MobileNetV3Small",
    "BertBackbone_tiny",
    "ViTBackbone_tiny",
]


def refresh_batchnorm(model, x):
    """Sets each BatchNormalization's moving statistics to those of `x`.

    With `weights=None` the statistics are mean 0, variance 1, and the
    signal of a deep network without skip connections dies out (a random
    MobileNet's logits are about 1e-17), which would make any relative L2
    vacuous. One forward pass in training mode with momentum 0 gives each
    layer the statistics of the inputs it sees at inference.
    """
    layers = [
        layer
        for layer in model.layers
        if isinstance(layer, keras.layers.BatchNormalization)
    ]
    if not layers:
        return
    momenta = [layer.momentum for layer in layers]
    for layer in layers:
        layer.momentum = 0.0
    model(x, training=True)
    for layer, momentum in zip(layers, momenta):
        layer.momentum = momentum


def _as_float64(value):
    """A serialized config with every float32 dtype (policy) -> float64."""
    if isinstance(value, list):
        return [_as_float64(v) for v in value]
    if isinstance(value, dict):
        if value.get("class_name") == "DTypePolicy":
            config = value.get("config", {})
            if config.get("name") == "float32":
                return {**value, "config": {**config, "name": "float64"}}
        return {k: _as_float64(v) for k, v in value.items()}
    return "float64" if value == "float32" else value


def float64_outputs(model, x):
    """`model`'s outputs on `x` computed in float64 (a copy rebuilt from its
    config with every float32 policy made float64, the same weights): the
    reference that both Keras float32 and ONNX Runtime float32 round away
    from. None when the model does not rebuild in float64."""
    try:
        serialized = keras.saving.serialize_keras_object(model)
        copy = keras.saving.deserialize_keras_object(
            _as_float64(serialized), safe_mode=False
        )
        for mine, theirs in zip(copy.weights, model.weights):
            mine.assign(np.asarray(theirs).astype(mine.dtype))
        x64 = keras.tree.map_structure(
            lambda a: a.astype(np.float64) if a.dtype == np.float32 else a, x
        )
        out = copy(x64, training=False)
    except Exception:  # a model that cannot be rebuilt: no reference
        return None
    flat = keras.tree.flatten(out)
    if any(np.asarray(o).dtype != np.float64 for o in flat):
        return None
    return np.concatenate([np.ravel(np.asarray(o)) for o in flat])


def _ort_outputs(path, x):
    """ONNX Runtime's outputs (graph optimizations off) on `x`, an array or
    a dict by input name (the ONNX inputs carry the Keras names)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    session = ort.InferenceSession(
        path, options, providers=["CPUExecutionProvider"]
    )
    names = [i.name for i in session.get_inputs()]
    feed = dict(x) if isinstance(x, dict) else {names[0]: x}
    return session.run(None, feed)


def _rel_l2(got, want):
    diff = np.linalg.norm(got.astype(np.float64) - want)
    return float(diff / max(np.linalg.norm(want), 1e-30))


def _first_line(error):
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def placement(path):
    """Q/DQ placement of an INT8 ONNX by `keras_mp.check_tensorrt`.

    Returns:
        dict: `lint_ok`, `violations`, `warnings` (the lint's warnings
        counted by rule), `qdq_nodes`, `weighted_ops`,
        `weighted_quantized` (Conv, ConvTranspose, MatMul, Gemm with a
        DequantizeLinear on both inputs), `coverage`, and `left_float`: per
        weighted op left without a DQ on both inputs, `"<op type> <node>"`.
    """
    import onnx

    from keras_mp.onnx.graph import GraphIndex

    report = keras_mp.check_tensorrt(path)
    proto = onnx.load(path)
    graph = GraphIndex(proto)
    left = [op for op in graph.weighted if not all(graph.quantized_inputs(op))]
    small = _small_gemms(proto, left)
    eligible = max(report.weighted_ops - len(small), 1)
    return {
        "lint_ok": report.ok,
        "violations": len(report.violations),
        "warnings": _count_rules(report.warnings),
        "qdq_nodes": report.num_qdq,
        "weighted_ops": report.weighted_ops,
        "weighted_quantized": report.weighted_ops_quantized,
        "coverage": report.weighted_ops_quantized / max(report.weighted_ops, 1),
        "left_float": [f"{op.op_type} {graph.name(op)}" for op in left],
        # MatMuls the small-GEMM rule keeps float (K or N below 16: an MoE
        # router, a relative-position table), and the coverage of the rest
        "small_gemms": len(small),
        "coverage_by_rule": report.weighted_ops_quantized / eligible,
    }


def _small_gemms(proto, ops):
    """The MatMul/Gemm nodes of `ops` whose K or N (from ONNX shape
    inference) is below the small-GEMM rule (`placement.gemm_too_small`)."""
    import onnx

    from keras_mp.quantization.placement import gemm_too_small

    inferred = onnx.shape_inference.infer_shapes(proto).graph
    shapes = {
        info.name: [
            d.dim_value or None for d in info.type.tensor_type.shape.dim
        ]
        for info in [*inferred.value_info, *inferred.input, *inferred.output]
    }
    shapes.update(
        {init.name: list(init.dims) for init in proto.graph.initializer}
    )
    small = []
    for op in ops:
        if op.op_type not in ("MatMul", "Gemm"):
            continue
        a, b = shapes.get(op.input[0]), shapes.get(op.input[1])
        if not a or not b or len(b) < 2:
            continue
        k, n = a[-1], b[-1]
        if gemm_too_small(k, n):
            small.append(op)
    return small


def _count_rules(findings):
    """{rule: number of findings}, rules in the order they first fire."""
    counts = {}
    for finding in findings:
        counts[finding.rule] = counts.get(finding.rule, 0) + 1
    return counts


def _warnings_text(counts):
    """`{"residual_add": 2}` -> "residual_add 2"; {} -> "none"."""
    if counts is None:
        return "-"
    return ", ".join(f"{rule} {n}" for rule, n in counts.items()) or "none"


def _onnx_input_names(path):
    import onnx

    graph = onnx.load(path, load_external_data=False).graph
    constants = {init.name for init in graph.initializer}
    return [i.name for i in graph.input if i.name not in constants]


def measure_modelopt(float_path, x, venv, timeout=1800, quantize_mode="int8"):
    """ModelOpt's ONNX PTQ (max calibration on `x`) of the float ONNX
    keras_mp exported, linted like ours.

    Args:
        float_path: str. The float ONNX; the calibration file, ModelOpt's
            ONNX and its log go beside it.
        x: array or dict of arrays by input name. The calibration inputs
            keras_mp calibrated on.
        venv: str. The ModelOpt venv (`bench_peers.py --setup` builds it).
        timeout: float. Seconds before ModelOpt is stopped.
        quantize_mode: str. ModelOpt's `--quantize_mode`, `"int8"` or
            `"fp8"`. Defaults to `"int8"`.

    Returns:
        dict of `modelopt_<key>` for each key of `placement`, plus
        `modelopt_error` (None when it ran), `modelopt_seconds` and
        `modelopt_onnx` (its file, beside `float_path`, when it ran).
    """
    sys.path.insert(0, os.path.join(HERE, "peers"))
    from modelopt_peer import run_modelopt

    row = {"modelopt_error": None, "modelopt_seconds": None}
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        row["modelopt_error"] = (
            f"no ModelOpt environment at {venv}: build it with "
            "python benchmarks/bench_peers.py --setup"
        )
        return row
    stem = os.path.splitext(float_path)[0]
    names = _onnx_input_names(float_path)
    feed = dict(x) if isinstance(x, dict) else {names[0]: x}
    np.savez(stem + "_calib.npz", **feed)
    mode = "" if quantize_mode == "int8" else f"_{quantize_mode}"
    dst = f"{stem}_modelopt{mode}_max.onnx"
    entry = run_modelopt(
        python,
        float_path,
        stem + "_calib.npz",
        "max",
        dst,
        timeout,
        quantize_mode,
    )
    row["modelopt_seconds"] = entry["seconds"]
    if not entry["ok"]:
        lines = entry["error"].strip().splitlines() or [""]
        row["modelopt_error"] = f"{entry['returncode']}: {lines[-1]}"
        return row
    row.update({f"modelopt_{k}": v for k, v in placement(dst).items()})
    row["modelopt_onnx"] = dst
    return row


def measure(name, directory, modelopt_venv=None, int8=True):
    """Builds zoo model `name`, exports it float and INT8, and measures.

    Args:
        name: str. A key of `ZOO`.
        directory: str. Where the `.onnx` files go.
        modelopt_venv: str or None. With a ModelOpt venv, ModelOpt's ONNX
            PTQ of the same float ONNX is measured too (`measure_modelopt`).
            Defaults to None (not run).
        int8: bool. Measure keras_mp's INT8 export; False for a ModelOpt
            pass alone. Defaults to True.

    Returns:
        dict: `source` (keras.applications or keras-hub), `params`;
        `float_error` (None when the float export and its parity check
        ran), `float_rel_l2`, `float_top1`, `float_seconds`;
        `int8_error`, `int8_lint_ok`, `int8_violations`,
        `int8_warnings`, `qdq_nodes`,
        `weighted_ops`, `weighted_quantized`, `coverage`, `left_float`,
        `int8_rel_l2`, `int8_seconds`; the `modelopt_*` keys of
        `measure_modelopt` with `modelopt_venv`; `logits_rms`, the root
        mean square of the Keras outputs (all of them) on the parity
        inputs (after `refresh_batchnorm`).

    Raises:
        ImportError: a keras-hub row without keras-hub installed.
    """
    build, make_inputs = ZOO[name]
    keras.utils.set_random_seed(0)
    model = build()
    rng = np.random.default_rng(0)
    x = make_inputs(rng, CALIBRATION)
    x_test = make_inputs(rng, SAMPLES)
    refresh_batchnorm(model, x)
    outputs = np.concatenate(
        [
            np.ravel(o)
            for o in keras.tree.flatten(model.predict(x_test, verbose=0))
        ]
    )
    reference = float64_outputs(model, x_test)
    row = {
        "model": name,
        "source": "keras-hub" if name in HUB else "keras.applications",
        "params": int(model.count_params()),
        "logits_rms": float(np.sqrt(np.mean(np.square(outputs)))),
        "keras_vs_float64": None
        if reference is None
        else _rel_l2(outputs, reference),
        "onnx_vs_float64": None,
    }

    path = os.path.join(directory, f"{name}_float.onnx")
    row.update(float_error=None, float_rel_l2=None, float_top1=None)
    try:
        start = time.perf_counter()
        keras_mp.export_onnx(model, path, overwrite=True)
        row["float_seconds"] = time.perf_counter() - start
        parity = keras_mp.verify_onnx(
            model, path, x_test, min_top1_agreement=0.0, max_rel_l2=1e9
        )
        row["float_rel_l2"] = float(parity.rel_l2)
        row["float_top1"] = float(parity.top1_agreement)
        if reference is not None:
            got = _ort_outputs(path, x_test)
            row["onnx_vs_float64"] = _rel_l2(
                np.concatenate([np.ravel(o) for o in got]), reference
            )
    except Exception as error:  # a finding, recorded in the table
        row["float_error"] = _first_line(error)

    if int8:
        row.update(
            _measure_int8(
                model, x, x_test, os.path.join(directory, f"{name}_int8.onnx")
            )
        )
    if modelopt_venv is not None:
        float_path = os.path.join(directory, f"{name}_float.onnx")
        if row["float_error"] is None:
            row.update(measure_modelopt(float_path, x, modelopt_venv))
        else:
            row["modelopt_error"] = "no float ONNX"
    return row


def _measure_int8(model, x, x_test, path):
    """keras_mp's INT8 stage of `measure`: quantize, calibrate on `x`,
    export to `path`, lint, and ONNX Runtime on `x_test`."""
    row = dict(
        int8_error=None,
        int8_lint_ok=None,
        int8_violations=None,
        int8_warnings=None,
        qdq_nodes=None,
        weighted_ops=None,
        weighted_quantized=None,
        coverage=None,
        left_float=None,
        int8_rel_l2=None,
    )
    try:
        qmodel = keras_mp.quantize_model(model)
        keras_mp.calibrate(qmodel, x, verbose=0)
        start = time.perf_counter()
        keras_mp.export_onnx(qmodel, path, overwrite=True)
        row["int8_seconds"] = time.perf_counter() - start
        found = placement(path)
        row.update(
            int8_lint_ok=found.pop("lint_ok"),
            int8_violations=found.pop("violations"),
            int8_warnings=found.pop("warnings"),
            **found,
        )
        parity = keras_mp.verify_onnx(
            qmodel, path, x_test, min_top1_agreement=0.0, max_rel_l2=1e9
        )
        row["int8_rel_l2"] = float(parity.rel_l2)
    except Exception as error:  # a finding, recorded in the table
        row["int8_error"] = _first_line(error)
    return row


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def _table(rows):
    header = [
        "model",
        "source",
        "parameters",
        "output RMS",
        "float export",
        "float rel L2",
        "rel L2 to float64: Keras / ONNX",
        "INT8 export",
        "INT8 lint",
        "INT8 lint warnings",
        "Q/DQ nodes",
        "weighted ops quantized / total",
        "coverage %",
        "INT8 rel L2 (info)",
        "export s (float / INT8)",
    ]
    body = []
    for r in rows:
        if r["float_error"]:
            float_ok = f"error: `{r['float_error']}`"
        else:
            float_ok = float_parity_verdict(r) or "parity over 1e-4"
        lint = "-"
        if r["int8_lint_ok"] is not None:
            lint = (
                "PASS"
                if r["int8_lint_ok"]
                else (f"FAIL ({r['int8_violations']})")
            )
        counts = "-"
        if r["weighted_ops"] is not None:
            counts = f"{r['weighted_quantized']} / {r['weighted_ops']}"
        coverage = r["coverage"]
        seconds = (
            f"{_fmt(r.get('float_seconds'), '.1f')} / "
            f"{_fmt(r.get('int8_seconds'), '.1f')}"
        )
        body.append(
            [
                r["model"],
                r["source"],
                f"{r['params']:,}",
                f"{r['logits_rms']:.2g}",
                float_ok,
                _fmt(r["float_rel_l2"], ".1e"),
                f"{_fmt(r.get('keras_vs_float64'), '.1e')} / "
                f"{_fmt(r.get('onnx_vs_float64'), '.1e')}",
                f"error: `{r['int8_error']}`" if r["int8_error"] else "ok",
                lint,
                _warnings_text(r.get("int8_warnings")),
                _fmt(r["qdq_nodes"], "d"),
                counts,
                "-" if coverage is None else f"{100 * coverage:.1f}",
                _fmt(r["int8_rel_l2"], ".1e"),
                seconds,
            ]
        )
    return markdown_table(header, body)


def _placement_summary(rows):
    """The coverage and economy goals over `rows`, in one paragraph."""
    measured = [r for r in rows if r.get("weighted_ops")]
    covered = [r for r in measured if r["coverage"] >= COVERAGE_GOAL]
    ops = sum(r["weighted_ops"] for r in measured)
    quantized = sum(r["weighted_quantized"] for r in measured)
    text = (
        f"Coverage goal (>= {100 * COVERAGE_GOAL:.0f}% of the weighted ops "
        "with a DequantizeLinear on both inputs, attention matmuls "
        f"included): {len(covered)}/{len(rows)} models; over the "
        f"{len(measured)} INT8 exports, {quantized}/{ops} weighted ops."
    )
    compared = [r for r in rows if economy_verdict(r) is not None]
    if compared:
        met = [r for r in compared if economy_verdict(r) == "met"]
        ours = sum(r["qdq_nodes"] for r in compared)
        theirs = sum(r["modelopt_qdq_nodes"] for r in compared)
        text += (
            f" Against ModelOpt on the same float ONNX: no more Q/DQ nodes at "
            f"equal or better coverage on {len(met)}/{len(compared)} models "
            f"({ours} Q/DQ nodes in all vs ModelOpt's {theirs})."
        )
    return text


def economy_verdict(row):
    """Whether keras_mp's INT8 ONNX of a zoo row is at least as economical
    as ModelOpt's: no more Q/DQ nodes at equal or better coverage ("met"),
    "more Q/DQ", "less coverage", or None when either side did not run."""
    if row.get("qdq_nodes") is None or row.get("modelopt_qdq_nodes") is None:
        return None
    if row["coverage"] < row["modelopt_coverage"]:
        return "less coverage"
    if row["qdq_nodes"] > row["modelopt_qdq_nodes"]:
        return "more Q/DQ"
    return "met"


def _left_float(names):
    """`["MatMul a", "MatMul b", "Conv c"]` -> "2 MatMul, 1 Conv"."""
    if names is None:
        return "-"
    if not names:
        return "none"
    counts = {}
    for name in names:
        op = name.split(" ")[0]
        counts[op] = counts.get(op, 0) + 1
    return ", ".join(f"{n} {op}" for op, n in counts.items())


def _placement_table(rows):
    header = [
        "model",
        "Q/DQ nodes: keras_mp / ModelOpt",
        "coverage %: keras_mp / ModelOpt",
        "weighted ops left float: keras_mp / ModelOpt",
        "ModelOpt lint",
        "economy",
    ]
    body = []
    for r in rows:
        coverage = r.get("coverage")
        theirs = r.get("modelopt_coverage")
        lint = "-"
        if r.get("modelopt_error"):
            lint = f"error: `{r['modelopt_error']}`"
        elif r.get("modelopt_lint_ok") is not None:
            lint = (
                "PASS"
                if r["modelopt_lint_ok"]
                else f"FAIL ({r['modelopt_violations']})"
            )
            if r.get("modelopt_warnings") is not None:
                lint += f"; warnings: {_warnings_text(r['modelopt_warnings'])}"
        verdict = economy_verdict(r) or "-"
        body.append(
            [
                r["model"],
                f"{_fmt(r.get('qdq_nodes'), 'd')} / "
                f"{_fmt(r.get('modelopt_qdq_nodes'), 'd')}",
                f"{_fmt(coverage and 100 * coverage, '.1f')} / "
                f"{_fmt(theirs and 100 * theirs, '.1f')}",
                f"{_left_float(r.get('left_float'))} / "
                f"{_left_float(r.get('modelopt_left_float'))}",
                lint,
                verdict,
            ]
        )
    return markdown_table(header, body)


def main():
    parser = bench_parser(__doc__, "the fast subset: " + ", ".join(QUICK))
    add_only(parser, sorted(ZOO))
    parser.add_argument(
        "--modelopt",
        nargs="?",
        const=MODELOPT_VENV,
        metavar="VENV",
        help="also run ModelOpt's ONNX PTQ on each float ONNX, from this "
        f"venv (default {os.path.relpath(MODELOPT_VENV)})",
    )
    parser.add_argument(
        "--modelopt-only",
        action="store_true",
        help="the ModelOpt pass alone (float export + ModelOpt), merged "
        "into the rows of the last full run",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="merge the rows measured into results/zoo.json instead of "
        "replacing it",
    )
    args = parser.parse_args()
    if args.modelopt_only and args.modelopt is None:
        args.modelopt = MODELOPT_VENV
    names = args.only or (QUICK if args.quick else list(ZOO))
    hub_rows = [name for name in names if name in HUB]
    if hub_rows:
        try:
            hub_models.keras_hub()
        except ImportError as error:
            parser.error(f"{error} (rows: {', '.join(hub_rows)})")
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for name in names:
            start = time.perf_counter()
            rows.append(
                measure(
                    name,
                    directory,
                    modelopt_venv=args.modelopt,
                    int8=not args.modelopt_only,
                )
            )
            print(
                f"{name}: {time.perf_counter() - start:.0f} s {rows[-1]}",
                flush=True,
            )
            keras.backend.clear_session()
    tools = modelopt_versions(args.modelopt) if args.modelopt else None
    runs = []
    if args.modelopt_only or args.merge:
        import json

        path = os.path.join(RESULTS, "zoo.json")
        with open(path) as f:
            last = json.load(f)
        runs = last.get("earlier_runs", []) + [last["command"]]
        tools = tools or last.get("modelopt_versions")
        earlier = {r["model"]: r for r in last["rows"]}
        for row in rows:
            if args.modelopt_only:
                keep = earlier.get(row["model"], row)
                row = {
                    **{k: v for k, v in keep.items() if "modelopt" not in k},
                    **{k: v for k, v in row.items() if "modelopt" in k},
                }
            earlier[row["model"]] = row
        rows = [earlier[name] for name in ZOO if name in earlier]
    float_ok = sum(float_parity_verdict(r) == "ok" for r in rows)
    float_noise = sum(
        float_parity_verdict(r) == "ok (float32 noise)" for r in rows
    )
    lint_ok = sum(bool(r["int8_lint_ok"]) for r in rows)
    # Rows measured before the warnings were recorded have none.
    counted = [r for r in rows if r.get("int8_warnings") is not None]
    quiet = sum(not r["int8_warnings"] for r in counted)
    full = sum(r["coverage"] == 1.0 for r in rows)
    summary = (
        f"{len(rows)} models; float export with relative L2 <= 1e-4 on "
        f"{SAMPLES} random inputs (ONNX Runtime, optimizations off): "
        f"{float_ok}/{len(rows)}, and {float_noise} more within float32's "
        f"own rounding (ONNX Runtime no further than {FLOAT32_NOISE_FACTOR}x "
        "Keras float32 from the model computed in float64); INT8 export "
        "lint-clean (no violation): "
        f"{lint_ok}/{len(rows)}, and without any lint warning: {quiet} of "
        f"the {len(counted)} rows that record warnings ('-': a row measured "
        "before they were recorded); every weighted op behind Q/DQ: "
        f"{full}/{len(rows)}. Random weights, logits "
        f"(`classifier_activation=None`) or backbone features; INT8 "
        f"calibrated (max) on {CALIBRATION} random inputs (images; token "
        f"ids in the vocabulary with padding masks). INT8 relative L2 is "
        f"information: random deep networks amplify one-step rounding flips."
    )
    markdown = INTRO + "\n\n" + summary + "\n\n" + _table(rows)
    placed = _placement_summary(rows)
    markdown += "\n\n" + PLACEMENT_INTRO + "\n\n" + placed + "\n\n"
    markdown += _placement_table(rows)
    if tools:
        markdown = f"ModelOpt environment: {tools}\n\n" + markdown
    if runs:
        merged = ", ".join(f"`{run}`" for run in runs)
        markdown = f"Rows merged into those of {merged}.\n\n" + markdown
    write_results(
        "zoo",
        {
            "summary": summary,
            "placement_summary": placed,
            "rows": rows,
            "earlier_runs": runs,
            "modelopt_versions": tools,
        },
        markdown,
        quick=args.quick,
    )


if __name__ == "__main__":
    main()

"""FP8 E4M3 beside INT8 on real Fashion-MNIST: PTQ, QAT, ONNX export with
FP8 Q/DQ, ONNX Runtime parity, and NVIDIA ModelOpt's FP8 on the same float
ONNX.

- data: Fashion-MNIST (Debian's `dataset-fashion-mnist`), 60,000 training
  and 10,000 test images in [0, 1]; calibration on the first 2,048
  training images for every tool;
- models, trained in float32 (Adam 1e-3, batch 128, shuffled):
  the reference CNN (`keras_mp.reference.reference_cnn`, width 16, as
  `bench_quantization.py`), and a row transformer (`row_transformer`):
  each image is 28 tokens (its rows) of 28 features -> Dense(64) -> 2
  blocks of MultiHeadAttention (4 heads) + Add + LayerNorm + MLP
  (Dense(128, gelu), Dense(64)) + Add + LayerNorm -> average pooling ->
  Dense(10) logits;
- PTQ: `quantize_model(precision=...)` + `calibrate`. CNN: INT8 max and
  percentile 99.99 (the INT8 recipe), FP8 max, percentile 99.9 (MLPerf's
  FP8 choice) and mse. Transformer: INT8 max and percentile 99.99, FP8
  max and percentile 99.9, and mixed: the MultiHeadAttention layers FP8
  (their projections and both attention matmuls), every Dense INT8,
  through a `config` dict regex, calibrated with max;
- FP8 QAT (CNN): the FP8 percentile 99.9 model fine-tuned one epoch
  (Adam, cosine decay from 1e-4, frozen ranges) against a float32 control
  fine-tuned the same epoch on the same batches in the same order with the
  same optimizer; the two alternate every 47 steps
  (`bench_quantization.interleaved_finetune`), mean over `--seeds` batch
  orders;
- which layers of an FP8 model run INT8 instead (TensorRT has no FP8
  kernel for a conv with <= 16 channels in or out or > 32 filter taps):
  the `note` of `quantization_report`;
- ONNX: every model exported with `export_onnx(verify_data=<test images>)`
  and linted with `check_tensorrt`; ONNX Runtime with graph optimizations
  off against Keras (relative L2, top-1 agreement) and its own top-1. ORT's
  default-optimized session is not used for FP8 figures: it drops a Relu
  in front of an FP8 QuantizeLinear (its agreement is recorded beside, as
  information). Q/DQ nodes and Conv/MatMul/Gemm are counted by format:
  the element type of the zero point (FLOAT8E4M3FN = 17, INT8 = 3);
- ModelOpt: `python -m modelopt.onnx.quantization --quantize_mode=fp8`
  (max calibration, on CPU) on the float32 ONNX keras_mp exported, with
  the same calibration images (`bench_zoo.measure_modelopt`), in the venv
  `--modelopt` (default: `benchmarks/.venv-modelopt`, which
  `bench_peers.py --setup` builds, else `/tmp/venv-modelopt`; skipped,
  with the reason, when it does not exist); its top-1
  with ONNX Runtime optimizations off and its formats counted the same way.

Goals (the FP8 issue, PASS or FAIL as measured): ORT parity (optimizations
off) within relative L2 1e-2 for every quantized export of the CNN and of
the transformer; every keras_mp export lint-clean; the float32 transformer
above 80% top-1 (full run; `--quick` trains on 4,096 images).

    python benchmarks/bench_fp8.py [--quick] [--seeds N] [--modelopt VENV]
"""

import argparse
import collections
import os
import re
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    add_modelopt,
    bench_parser,
    markdown_table,
    modelopt_venv,
    verdicts_json,
    write_results,
)
from _timing import paired_ratio  # noqa: E402
from bench_quantization import interleaved_finetune  # noqa: E402
from bench_sequence import _export, _ort_top1, top1  # noqa: E402
from bench_zoo import MODELOPT_VENV as BENCH_ZOO_VENV  # noqa: E402
from bench_zoo import measure_modelopt  # noqa: E402

import keras_mp  # noqa: E402
from keras_mp.reference import compile_classifier, reference_cnn  # noqa: E402

BATCH = 128
WIDTH = 16
# ModelOpt's venv: the one `bench_peers.py --setup` builds, else this
# machine's shared one.
MODELOPT_VENV = next(
    (v for v in (BENCH_ZOO_VENV, "/tmp/venv-modelopt") if os.path.isdir(v)),
    BENCH_ZOO_VENV,
)
FULL = {
    "train_images": 60000,
    "test_images": 10000,
    "calib_images": 2048,
    "cnn_epochs": 3,
    "transformer_epochs": 3,
    "seeds": 2,
    "chunk_steps": 47,
}
QUICK = {
    "train_images": 4096,
    "test_images": 2000,
    "calib_images": 512,
    "cnn_epochs": 2,
    "transformer_epochs": 1,
    "seeds": 1,
    "chunk_steps": 8,
}
FP8 = keras_mp.QuantizeConfig(precision="float8")
# label -> (quantize_model keyword arguments, calibrate keyword arguments)
BOTH_MODELS = {
    "int8_max": ({}, {"method": "max"}),
    "int8_percentile_99.99": ({}, {"method": "percentile"}),
    "fp8_max": ({"precision": "float8"}, {"method": "max"}),
    "fp8_percentile_99.9": (
        {"precision": "float8"},
        {"method": "percentile", "percentile": 99.9},
    ),
}
CNN_VARIANTS = {
    **BOTH_MODELS,
    "fp8_mse": ({"precision": "float8"}, {"method": "mse"}),
}
QAT_START = "fp8_percentile_99.9"
TRANSFORMER_VARIANTS = {
    **BOTH_MODELS,
    "mixed_mha_fp8_rest_int8_max": (
        {"config": {r"block\d+_mha": FP8}},
        {"method": "max"},
    ),
}
GOALS = {"max_rel_l2": 1e-2, "transformer_min_top1": 80.0}


def row_transformer(dim=64, heads=4, blocks=2, mlp=128):
    """Rows of a 28x28 image as tokens -> transformer blocks -> logits.

    Args:
        dim: int. Width of the tokens. Defaults to 64.
        heads: int. Attention heads (key size `dim // heads`). Defaults
            to 4.
        blocks: int. Post-norm transformer blocks. Defaults to 2.
        mlp: int. Hidden width of each block's MLP. Defaults to 128.

    Returns:
        An uncompiled `keras.Model` from `(28, 28)` to 10 logits.
    """
    layers = keras.layers
    inputs = keras.Input((28, 28), name="rows")
    x = layers.Dense(dim, name="embed")(inputs)
    for i in range(blocks):
        attention = layers.MultiHeadAttention(
            heads, dim // heads, name=f"block{i}_mha"
        )(x, x)
        x = layers.Add(name=f"block{i}_add1")([x, attention])
        x = layers.LayerNormalization(name=f"block{i}_ln1")(x)
        h = layers.Dense(mlp, activation="gelu", name=f"block{i}_mlp1")(x)
        h = layers.Dense(dim, name=f"block{i}_mlp2")(h)
        x = layers.Add(name=f"block{i}_add2")([x, h])
        x = layers.LayerNormalization(name=f"block{i}_ln2")(x)
    x = layers.GlobalAveragePooling1D(name="pool")(x)
    outputs = layers.Dense(10, name="logits")(x)
    return keras.Model(inputs, outputs, name="row_transformer")


def onnx_formats(path):
    """Q/DQ nodes and weighted ops of an ONNX file by number format.

    The format of a Q/DQ node is the element type of its zero point
    (FLOAT8E4M3FN: fp8, INT8: int8); a Conv, MatMul or Gemm is fp8 or int8
    when a DequantizeLinear of that format feeds both its inputs, float
    when none does, and mixed otherwise.

    Returns:
        dict: `qdq_fp8`, `qdq_int8`, `qdq_other`, `weighted_ops`, and
        `weighted_fp8`, `weighted_int8`, `weighted_float`,
        `weighted_mixed`.
    """
    import onnx

    from keras_mp.onnx.graph import FLOAT8E4M3FN, INT8, GraphIndex

    graph = GraphIndex(onnx.load(path))
    names = {FLOAT8E4M3FN: "fp8", INT8: "int8"}

    def fmt(node):
        if node is None:
            return "float"
        zero = node.input[2] if len(node.input) > 2 else ""
        return names.get(graph.dtypes.get(zero), "other")

    qdq = collections.Counter(fmt(n) for n in graph.qdq)
    ops = collections.Counter()
    for op in graph.weighted:
        kinds = {fmt(graph.trace(t).dq) for t in op.input[:2]}
        ops[kinds.pop() if len(kinds) == 1 else "mixed"] += 1
    return {
        "qdq_fp8": qdq["fp8"],
        "qdq_int8": qdq["int8"],
        "qdq_other": qdq["other"],
        "weighted_ops": len(graph.weighted),
        **{f"weighted_{k}": ops[k] for k in ("fp8", "int8", "float", "mixed")},
    }


def export_row(model, path, xt, yt):
    """`bench_sequence._export`'s figures plus `onnx_formats`, or
    `{"error": <its first line>}` when the export fails (the run goes on
    and the goals say so)."""
    try:
        row = _export(model, path, xt, yt)
    except Exception as e:  # recorded, not hidden: see `verdicts`
        text = re.sub(r"\S*\.onnx\b", "<file>", str(e))
        return {"error": f"{type(e).__name__}: {text.strip()}"}
    row.pop("recurrent_onnx_ops")
    row["lint_violations"] = len(keras_mp.check_tensorrt(path).violations)
    row.update(onnx_formats(path))
    return row


def int8_fallbacks(qmodel):
    """The layers of `qmodel` asked in FP8 that are quantized in another
    format, with the note of `quantization_report` (why TensorRT takes
    them in INT8)."""
    rows = keras_mp.quantization_report(qmodel, verbose=False).rows
    return [
        {"path": r["path"], "type": r["type"], "note": r["note"]}
        for r in rows
        if r["quantized"] and r.get("format") != "float8" and r["note"]
    ]


def formats_by_layer(qmodel):
    """{format: number of quantized layers} from `quantization_report`."""
    rows = keras_mp.quantization_report(qmodel, verbose=False).rows
    return dict(
        collections.Counter(r.get("format") for r in rows if r["quantized"])
    )


def train_float(build, x, y, epochs, seed):
    keras.utils.set_random_seed(seed)
    model = compile_classifier(build())
    start = time.perf_counter()
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=True, verbose=2)
    return model, round(time.perf_counter() - start, 1)


def measure_model(
    name, build, variants, data, setting, directory, seed, modelopt
):
    """Float32 training, PTQ per variant, ONNX of each, ModelOpt FP8.

    Returns:
        (figures, float model, {label: quantized model}).
    """
    x, y, xt, yt, xc = data
    out = {"seconds": {}}
    clock = time.perf_counter()
    epochs = setting[f"{name}_epochs"]
    fmodel, out["seconds"]["float32_train"] = train_float(
        build, x, y, epochs, seed
    )
    out["params"] = fmodel.count_params()
    out["float32_top1"] = top1(fmodel, xt, yt)
    print(f"{name}: float32 test top-1 {out['float32_top1']:.2f}", flush=True)
    float_path = os.path.join(directory, f"{name}_float32.onnx")
    out["onnx"] = {"float32": export_row(fmodel, float_path, xt, yt)}

    out["ptq"], qmodels = {}, {}
    for label, (quantize_kw, calibrate_kw) in variants.items():
        qmodel = keras_mp.quantize_model(fmodel, **quantize_kw)
        start = time.perf_counter()
        keras_mp.calibrate(
            qmodel, xc, batch_size=BATCH, verbose=0, **calibrate_kw
        )
        calib_s = time.perf_counter() - start
        compile_classifier(qmodel)
        acc = top1(qmodel, xt, yt)
        out["ptq"][label] = {
            "test_top1": acc,
            "delta_vs_float32_points": round(acc - out["float32_top1"], 2),
            "calibration_seconds": round(calib_s, 2),
            "layers_by_format": formats_by_layer(qmodel),
            "not_fp8": int8_fallbacks(qmodel),
        }
        qmodels[label] = qmodel
        path = os.path.join(directory, f"{name}_{label}.onnx")
        out["onnx"][label] = export_row(qmodel, path, xt, yt)
        print(f"{name} {label}: {out['ptq'][label]}", flush=True)
        print(f"{name} {label} ONNX: {out['onnx'][label]}", flush=True)
    out["modelopt_fp8"] = modelopt_fp8(float_path, xc, xt, yt, modelopt)
    print(f"{name} ModelOpt FP8: {out['modelopt_fp8']}", flush=True)
    out["seconds"]["total"] = round(time.perf_counter() - clock, 1)
    return out, fmodel, qmodels


def modelopt_fp8(float_path, xc, xt, yt, venv):
    """ModelOpt FP8 PTQ of `float_path` (`bench_zoo.measure_modelopt`),
    its ONNX Runtime top-1 (optimizations off) and formats."""
    if venv is None:
        return {"error": "not run (--no-modelopt)"}
    found = measure_modelopt(float_path, xc, venv, quantize_mode="fp8")
    row = {k.removeprefix("modelopt_"): v for k, v in found.items()}
    if row["error"]:
        return row
    path = row.pop("onnx")
    row["ort_top1"] = _ort_top1(path, xt, yt)
    row.update(onnx_formats(path))
    return row


def qat_vs_control(fmodel, x, y, xt, yt, xc, setting, seed, directory):
    """FP8 QAT from `QAT_START` against the float32 control, per seed;
    the first seed's QAT model exported."""
    quantize_kw, calibrate_kw = CNN_VARIANTS[QAT_START]
    float_weights = fmodel.get_weights()
    # bench_quantization's fine-tune: cosine decay from 1e-4, the two
    # models alternating every `chunk_steps` steps.
    schedule = argparse.Namespace(
        finetune_lr=1e-4, chunk_steps=setting["chunk_steps"]
    )
    runs = []
    for fseed in range(seed + 1, seed + 1 + setting["seeds"]):
        order = np.random.default_rng(fseed).permutation(len(x))
        xf, yf = x[order], y[order]
        steps = int(np.ceil(len(xf) / BATCH))
        keras.utils.set_random_seed(fseed)
        control = keras.models.clone_model(fmodel)
        control.set_weights(float_weights)
        qat = keras_mp.quantize_model(fmodel, **quantize_kw)
        keras_mp.calibrate(qat, xc, batch_size=BATCH, verbose=0, **calibrate_kw)
        timers = dict(
            zip(
                ("control", "qat"),
                interleaved_finetune(control, qat, xf, yf, schedule, steps),
            )
        )
        _, per_turn, _ = paired_ratio(timers, "control", "qat")
        run = {
            "seed": fseed,
            "control_top1": top1(control, xt, yt),
            "qat_top1": top1(qat, xt, yt),
            "step_ratio": round(per_turn, 3),
        }
        run["delta_points"] = round(run["qat_top1"] - run["control_top1"], 2)
        print(f"cnn FP8 QAT seed {fseed}: {run}", flush=True)
        runs.append(run)
        if len(runs) == 1:
            path = os.path.join(directory, "cnn_fp8_qat.onnx")
            exported = export_row(qat, path, xt, yt)
    return {
        "start": QAT_START,
        "runs": runs,
        "qat_top1_mean": round(np.mean([r["qat_top1"] for r in runs]), 2),
        "control_top1_mean": round(
            np.mean([r["control_top1"] for r in runs]), 2
        ),
        "qat_minus_control_points": round(
            np.mean([r["delta_points"] for r in runs]), 2
        ),
        "onnx_first_seed": exported,
    }


def measure(directory, quick=False, seed=0, seeds=None, modelopt=None):
    """The whole benchmark.

    Args:
        directory: str. Folder for the ONNX files.
        quick: bool. The `QUICK` setting instead of `FULL`.
        seed: int. Seed of the float32 trainings; fine-tune seeds follow.
        seeds: int. FP8 QAT fine-tune seeds. Defaults to the setting's.
        modelopt: str or None. ModelOpt's venv; None skips ModelOpt.

    Returns:
        dict: `setting`, `cnn`, `transformer` (see `measure_model`), the
        CNN's `qat`, and `seconds`.

    Raises:
        DatasetError: Fashion-MNIST is not installed.
    """
    setting = dict(QUICK if quick else FULL)
    if seeds:
        setting["seeds"] = seeds
    clock = time.perf_counter()
    (x, y), (xt, yt) = keras_mp.datasets.load_fashion_mnist()
    x, y = x[: setting["train_images"]], y[: setting["train_images"]]
    xt, yt = xt[: setting["test_images"]], yt[: setting["test_images"]]
    xc = x[: setting["calib_images"]]
    out = {"setting": setting}
    out["cnn"], fmodel, _ = measure_model(
        "cnn",
        lambda: reference_cnn(width=WIDTH),
        CNN_VARIANTS,
        (x, y, xt, yt, xc),
        setting,
        directory,
        seed,
        modelopt,
    )
    start = time.perf_counter()
    out["cnn"]["qat"] = qat_vs_control(
        fmodel, x, y, xt, yt, xc, setting, seed, directory
    )
    out["cnn"]["seconds"]["qat"] = round(time.perf_counter() - start, 1)
    sequences = (x[..., 0], y, xt[..., 0], yt, xc[..., 0])
    out["transformer"], _, _ = measure_model(
        "transformer",
        row_transformer,
        TRANSFORMER_VARIANTS,
        sequences,
        setting,
        directory,
        seed,
        modelopt,
    )
    out["seconds"] = round(time.perf_counter() - clock, 1)
    return out


def quantized_exports(run):
    """(model, label, ONNX row) of every quantized keras_mp export."""
    for name in ("cnn", "transformer"):
        for label, row in run[name]["onnx"].items():
            if label != "float32":
                yield name, label, row
    yield "cnn", "fp8_qat", run["cnn"]["qat"]["onnx_first_seed"]


def verdicts(run):
    """{goal: (pass, text)} for the figures of `measure`."""
    found = {}
    limit = GOALS["max_rel_l2"]
    for name in ("cnn", "transformer"):
        rows = [(lb, r) for n, lb, r in quantized_exports(run) if n == name]
        failed = [lb for lb, r in rows if "error" in r]
        rows = [(lb, r) for lb, r in rows if "error" not in r]
        worst_label, worst = max(
            rows, key=lambda item: item[1]["rel_l2"], default=("-", None)
        )
        largest = worst["rel_l2"] if worst else float("nan")
        text = (
            f"{name}: largest ORT relative L2 over {len(rows)} quantized "
            f"exports {largest:.2e} ({worst_label}; goal <= {limit:g})"
        )
        if failed:
            text += "; export failed: " + ", ".join(failed)
        found[f"{name}_ort_parity_rel_l2"] = (
            largest <= limit and not failed,
            text,
        )
    unclean = [
        f"{n} {lb}"
        for n, lb, r in quantized_exports(run)
        if not r.get("lint_ok", True)
    ]
    found["lint_clean"] = (
        not unclean,
        "every quantized export lint-clean"
        if not unclean
        else "lint fails: " + ", ".join(unclean),
    )
    acc = run["transformer"]["float32_top1"]
    found["transformer_float32_top1"] = (
        acc > GOALS["transformer_min_top1"],
        f"float32 transformer top-1 {acc:.2f}% (goal > "
        f"{GOALS['transformer_min_top1']:g}%)",
    )
    return found


def _formats_text(row):
    return (
        f"{row['qdq_fp8']} / {row['qdq_int8']}",
        f"{row['weighted_fp8']} / {row['weighted_int8']} / "
        f"{row['weighted_float'] + row['weighted_mixed']}",
    )


def _export_cells(o):
    if "error" in o:
        return ("export failed (below)", *[""] * 6)
    return (
        f"{o['ort_top1']:.2f}",
        f"{o['rel_l2']:.2e}",
        f"{o['top1_agreement_percent']:.2f}",
        f"{o['ort_optimized_top1_agreement_percent']:.2f}",
        "PASS" if o["lint_ok"] else f"FAIL ({o['lint_violations']})",
        *_formats_text(o),
    )


def _model_rows(name, r):
    f = r["float32_top1"]
    rows = [("float32", f"{f:.2f}", "", *_export_cells(r["onnx"]["float32"]))]
    for label, p in r["ptq"].items():
        rows.append(
            (
                f"PTQ {label}",
                f"{p['test_top1']:.2f}",
                f"{p['delta_vs_float32_points']:+.2f}",
                *_export_cells(r["onnx"][label]),
            )
        )
    if "qat" in r:
        q = r["qat"]
        first = q["runs"][0]
        rows.append(
            (
                "float32 control (+1 ep), first seed",
                f"{first['control_top1']:.2f}",
                f"{first['control_top1'] - f:+.2f}",
                *[""] * 7,
            )
        )
        rows.append(
            (
                f"FP8 QAT from {q['start']} (+1 ep), first seed",
                f"{first['qat_top1']:.2f}",
                f"{first['qat_top1'] - f:+.2f}",
                *_export_cells(q["onnx_first_seed"]),
            )
        )
    m = r["modelopt_fp8"]
    if m.get("error"):
        rows.append(("ModelOpt FP8 (max)", f"not run: {m['error']}", *[""] * 8))
    else:
        rows.append(
            (
                "ModelOpt FP8 (max), same float ONNX",
                "",
                "",
                f"{m['ort_top1']:.2f}",
                "",
                "",
                "",
                "PASS" if m["lint_ok"] else f"FAIL ({m['violations']})",
                *_formats_text(m),
            )
        )
    return [(name, *row) for row in rows]


def _fallback_text(rows):
    """Layers with the same note under one note: "stem, dw: <note>"."""
    by_note = collections.defaultdict(list)
    for row in rows:
        by_note[row["note"]].append(f"`{row['path']}`")
    return "; ".join(f"{', '.join(p)}: {n}" for n, p in by_note.items()) or "-"


def _markdown(results):
    run = results["run"]
    s = run["setting"]
    intro = (
        f"Fashion-MNIST, {s['train_images']:,} training images, top-1 on "
        f"{s['test_images']:,} test images; calibration on "
        f"{s['calib_images']:,} training images (every tool). Reference CNN "
        f"(width {WIDTH}) trained {s['cnn_epochs']} float32 epochs; row "
        "transformer (28 row tokens -> Dense(64) -> 2 x [MultiHeadAttention "
        "4 heads, LayerNorm, MLP 128 GELU] -> average pooling -> Dense(10)) "
        f"trained {s['transformer_epochs']} epochs (Adam 1e-3, batch "
        f"{BATCH}). PTQ: `quantize_model(precision=...)` + `calibrate`; "
        "mixed: the MultiHeadAttention layers FP8 (`config="
        '{"block\\d+_mha": QuantizeConfig(precision="float8")}`), the rest '
        "INT8. FP8 QAT: fine-tuned one epoch (Adam, cosine decay from 1e-4, "
        "frozen ranges) against a float32 control given the same batches, "
        "order and optimizer. Every model exported with `export_onnx` "
        "(verify_data: the test images); ORT: ONNX Runtime with graph "
        "optimizations off (its default-optimized session drops a Relu "
        "before an FP8 QuantizeLinear, so its agreement is information "
        "only). Q/DQ and Conv/MatMul/Gemm counted by the zero point's type "
        "(FLOAT8E4M3FN / INT8). ModelOpt: `--quantize_mode=fp8` on the "
        f"float32 ONNX keras_mp exported ({results['modelopt']})."
    )
    rows = _model_rows("CNN", run["cnn"]) + _model_rows(
        "transformer", run["transformer"]
    )
    table = markdown_table(
        (
            "model",
            "variant",
            "Keras top-1 %",
            "vs float32",
            "ORT top-1 %",
            "ORT rel. L2",
            "ORT agreement %",
            "ORT default-opt agreement %",
            "lint",
            "Q/DQ FP8 / INT8",
            "Conv/MatMul/Gemm FP8 / INT8 / float",
        ),
        rows,
    )
    q = run["cnn"]["qat"]
    qat_table = markdown_table(
        ("fine-tune seed", "control %", "FP8 QAT %", "QAT - control", "step"),
        [
            (
                r["seed"],
                f"{r['control_top1']:.2f}",
                f"{r['qat_top1']:.2f}",
                f"{r['delta_points']:+.2f}",
                f"{r['step_ratio']:.2f}x",
            )
            for r in q["runs"]
        ]
        + [
            (
                "mean",
                f"{q['control_top1_mean']:.2f}",
                f"{q['qat_top1_mean']:.2f}",
                f"{q['qat_minus_control_points']:+.2f}",
                "",
            )
        ],
    )
    fallback_rows = [
        (
            name,
            label,
            ", ".join(f"{k} {v}" for k, v in p["layers_by_format"].items()),
            _fallback_text(p["not_fp8"]),
        )
        for name in ("cnn", "transformer")
        for label, p in run[name]["ptq"].items()
        if "int8" not in label or "fp8" in label
    ]
    fallback = markdown_table(
        ("model", "variant", "layers by format", "not FP8 (report note)"),
        fallback_rows,
    )
    failures = "".join(
        f"- {name} {label}: {row['error'][:400]}\n"
        for name, label, row in quantized_exports(run)
        if "error" in row
    )
    if failures:
        failures = (
            "\n\nExports that failed (first 400 characters):\n\n" + failures
        )
    goals = markdown_table(
        ("goal", "result", "measured"),
        [
            (goal, "PASS" if v["pass"] else "FAIL", v["measured"])
            for goal, v in results["verdicts"].items()
        ],
    )
    return (
        intro
        + "\n\n"
        + table
        + "\n\nFP8 QAT against the float32 control (CNN, per fine-tune seed; "
        "step: QAT step / control step, alternating turns, information):"
        "\n\n"
        + qat_table
        + "\n\nLayers of the FP8 and mixed models that TensorRT runs in INT8 "
        "(`quantization_report`):\n\n"
        + fallback
        + failures.rstrip()
        + "\n\nGoals, as measured:\n\n"
        + goals
        + f"\n\nRun time: {run['seconds']:.0f} s."
    )


def main():
    parser = bench_parser(
        __doc__,
        f"smoke run: {QUICK['train_images']} training and "
        f"{QUICK['test_images']} test images, 1-2 epochs, one seed",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--seeds", type=int, default=None, help="FP8 QAT fine-tune seeds"
    )
    add_modelopt(parser, MODELOPT_VENV)
    args = parser.parse_args()
    venv, modelopt = modelopt_venv(args)
    with tempfile.TemporaryDirectory() as folder:
        run = measure(folder, args.quick, args.seed, args.seeds, venv)
    results = {
        "run": run,
        "modelopt": modelopt,
        "goals": GOALS,
        "verdicts": verdicts_json(verdicts(run)),
    }
    write_results("fp8", results, _markdown(results), quick=args.quick)


if __name__ == "__main__":
    main()

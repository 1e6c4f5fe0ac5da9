"""Recurrent classifiers on real Fashion-MNIST read as sequences: float32,
INT8 PTQ, INT8 QAT and a float32 control given the same extra epoch, ONNX
parity (issue 23, item 9).

- data: Fashion-MNIST (Debian's `dataset-fashion-mnist`), 60,000 training
  and 10,000 test images; each 28x28 image is read as 28 time steps (its
  rows) of 28 features in [0, 1];
- models (`sequence_model`): a Dense(32, relu) projection of each row, a
  recurrent layer of 64 units (`LSTM`, `GRU`, or `Bidirectional(LSTM)`:
  64 per direction), a Dense(10) logits head; float32, trained with Adam
  1e-3, batch 128, shuffled;
- PTQ: `quantize_model` + `calibrate` (max and percentile) on 2,048
  training images. The recurrent layer stays float (TensorRT builds an
  ONNX LSTM/GRU op's matmuls from float inputs: `docs/export.md`,
  "Recurrent layers"); the projection and the head are INT8. What runs in
  float is taken from `quantization_report` and from the lint of the ONNX;
- QAT: the model calibrated with percentile (the recipe of
  `bench_quantization.py`) fine-tuned one epoch, Adam with cosine decay
  from 1e-4, frozen activation ranges; the float32 control: a copy of the
  float model fine-tuned the same epoch on the same batches in the same
  order with the same optimizer. The two alternate every 47 steps
  (`_timing.interleaved_fit`), so the step-time ratio beside them is
  paired (information, no goal). One seed moves top-1 by a few tenths, so
  the pair runs for `--seeds` batch orders and the mean difference is
  judged;
- ONNX: the float32 model, the percentile PTQ model and the first seed's
  QAT model exported with `export_onnx(verify_data=<all test images>)`;
  ONNX Runtime (graph optimizations off) against Keras on every test
  image: top-1 agreement, relative L2, and ONNX Runtime's own top-1;
  `check_tensorrt` on each file.

Goals (issue 23, per model, PASS or FAIL as measured): QAT >= control - 0.3
point (mean over seeds); ONNX top-1 agreement >= 99.5% for the INT8 (QAT
and PTQ) and the float32 exports.

    python benchmarks/bench_sequence.py [--quick] [--models lstm gru bilstm]
"""

import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    bench_parser,
    markdown_table,
    verdicts_json,
    write_results,
)
from _timing import interleaved_fit, paired_ratio  # noqa: E402

import keras_mp  # noqa: E402
from keras_mp.reference import compile_classifier, cosine_adam  # noqa: E402

MODELS = ("lstm", "gru", "bilstm")
UNITS = 64
PROJECTION = 32
BATCH = 128
CALIBRATORS = ("max", "percentile")
QAT_CALIBRATOR = "percentile"
FULL = {
    "train_images": 60000,
    "test_images": 10000,
    "calib_images": 2048,
    "epochs": 3,
    "seeds": 2,
    "chunk_steps": 47,
}
QUICK = {
    "train_images": 2048,
    "test_images": 2000,
    "calib_images": 512,
    "epochs": 1,
    "seeds": 1,
    "chunk_steps": 8,
}
GOALS = {"qat_minus_control_points": -0.3, "min_agreement_percent": 99.5}


def sequence_model(kind, units=UNITS, projection=PROJECTION):
    """Rows of a 28x28 image -> Dense projection -> recurrent -> logits.

    Args:
        kind: str. `"lstm"`, `"gru"` or `"bilstm"` (`Bidirectional(LSTM)`).
        units: int. Units of the recurrent layer (per direction).
        projection: int. Width of the Dense applied to each row.

    Returns:
        An uncompiled `keras.Model` from `(28, 28)` to 10 logits.
    """
    layers = keras.layers
    recurrent = {
        "lstm": lambda: layers.LSTM(units, name="lstm"),
        "gru": lambda: layers.GRU(units, name="gru"),
        "bilstm": lambda: layers.Bidirectional(
            layers.LSTM(units), name="bilstm"
        ),
    }
    if kind not in recurrent:
        raise ValueError(
            f"Unknown sequence model {kind!r}: use one of {sorted(recurrent)}."
        )
    inputs = keras.Input((28, 28), name="rows")
    x = layers.Dense(projection, activation="relu", name="projection")(inputs)
    x = recurrent[kind]()(x)
    outputs = layers.Dense(10, name="logits")(x)
    return keras.Model(inputs, outputs, name=f"{kind}_fashion_mnist")


def load_sequences(setting):
    """Fashion-MNIST as `(N, 28, 28)` sequences, sliced for `setting`."""
    (x, y), (xt, yt) = keras_mp.datasets.load_fashion_mnist()
    x, xt = x[..., 0], xt[..., 0]
    n, nt = setting["train_images"], setting["test_images"]
    return (x[:n], y[:n]), (xt[:nt], yt[:nt])


def top1(model, xt, yt):
    _, acc = model.evaluate(xt, yt, batch_size=1000, verbose=0)
    return round(100 * float(acc), 2)


def _ort_top1(path, xt, yt):
    """ONNX Runtime's own test top-1 (graph optimizations off)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    off = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.graph_optimization_level = off
    session = ort.InferenceSession(
        path, options, providers=["CPUExecutionProvider"]
    )
    name = session.get_inputs()[0].name
    logits = np.concatenate(
        [
            session.run(None, {name: xt[i : i + 1000]})[0]
            for i in range(0, len(xt), 1000)
        ]
    )
    return round(100 * float(np.mean(np.argmax(logits, 1) == yt)), 2)


def _export(model, path, xt, yt):
    """Exports `model`, parity on every test image; figures and lint."""
    import onnx

    rep = keras_mp.export_onnx(
        model,
        path,
        verify_data=xt,
        overwrite=True,
        min_top1_agreement=0.0,
        max_rel_l2=float("inf"),
    )
    lint = keras_mp.check_tensorrt(path)
    ops = [n.op_type for n in onnx.load(path).graph.node]
    return {
        "samples": rep.samples,
        "top1_agreement_percent": round(100 * rep.top1_agreement, 2),
        "rel_l2": float(f"{rep.rel_l2:.3g}"),
        "max_abs_diff": float(f"{rep.max_abs_diff:.3g}"),
        "ort_optimized_top1_agreement_percent": round(
            100 * rep.optimized_top1_agreement, 2
        ),
        "ort_top1": _ort_top1(path, xt, yt),
        "lint_ok": lint.ok,
        "qdq_nodes": lint.num_qdq,
        "weighted_ops": lint.weighted_ops,
        "weighted_ops_quantized": lint.weighted_ops_quantized,
        "lint_warnings": [f"{w.rule}: {w.message}" for w in lint.warnings],
        "recurrent_onnx_ops": sorted(
            {op for op in ops if op in ("LSTM", "GRU", "RNN", "Loop", "Scan")}
        ),
    }


def _float_layers(qmodel):
    """`quantization_report` rows that run in float and hold weights
    (the recurrent layers): path, type, note."""
    rows = keras_mp.quantization_report(qmodel, verbose=False).rows
    quantized = [r["path"] for r in rows if r["quantized"]]
    recurrent = [
        {"path": r["path"], "type": r["type"], "note": r["note"]}
        for r in rows
        if not r["quantized"] and r["note"].startswith("recurrent")
    ]
    return quantized, recurrent


def measure(kind, directory, quick=False, seed=0, seeds=None):
    """The benchmark for one model kind.

    Args:
        kind: str. One of `MODELS`.
        directory: str. Folder for the ONNX files.
        quick: bool. The `QUICK` setting instead of `FULL`.
        seed: int. Seed of the float32 training; fine-tune seeds follow.
        seeds: int. Fine-tune seeds (batch orders). Defaults to the
            setting's.

    Returns:
        dict of the measured figures (see `main`'s JSON).

    Raises:
        DatasetError: Fashion-MNIST is not installed.
    """
    setting = dict(QUICK if quick else FULL)
    if seeds:
        setting["seeds"] = seeds
    (x, y), (xt, yt) = load_sequences(setting)
    xc = x[: setting["calib_images"]]
    out = {"model": kind, "setting": setting, "seconds": {}}
    clock = time.perf_counter()

    keras.utils.set_random_seed(seed)
    fmodel = compile_classifier(sequence_model(kind))
    out["params"] = fmodel.count_params()
    start = time.perf_counter()
    fmodel.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=setting["epochs"],
        shuffle=True,
        verbose=2,
    )
    out["seconds"]["float32_train"] = round(time.perf_counter() - start, 1)
    out["float32_top1"] = top1(fmodel, xt, yt)
    float_weights = fmodel.get_weights()
    print(f"{kind}: float32 test top-1 {out['float32_top1']:.2f}")

    ptq, ptq_models = {}, {}
    for method in CALIBRATORS:
        qmodel = keras_mp.quantize_model(fmodel)
        keras_mp.calibrate(qmodel, xc, method=method, verbose=0)
        compile_classifier(qmodel)
        acc = top1(qmodel, xt, yt)
        ptq[method] = {
            "test_top1": acc,
            "delta_vs_float32_points": round(acc - out["float32_top1"], 2),
        }
        ptq_models[method] = qmodel
        print(f"{kind}: PTQ {method} {acc:.2f}")
    out["ptq"] = ptq
    quantized, recurrent = _float_layers(ptq_models[QAT_CALIBRATOR])
    out["quantized_layers"] = quantized
    out["float_layers"] = recurrent

    runs = []
    for fseed in range(seed + 1, seed + 1 + setting["seeds"]):
        order = np.random.default_rng(fseed).permutation(len(x))
        xf, yf = x[order], y[order]
        steps = int(np.ceil(len(xf) / BATCH))
        keras.utils.set_random_seed(fseed)
        control = keras.models.clone_model(fmodel)
        control.set_weights(float_weights)
        qat = keras_mp.quantize_model(fmodel)
        keras_mp.calibrate(qat, xc, method=QAT_CALIBRATOR, verbose=0)
        for model in (control, qat):
            compile_classifier(model, optimizer=cosine_adam(steps, 1e-4))
        start = time.perf_counter()
        timers = interleaved_fit(
            {"control": (control, []), "qat": (qat, [])},
            xf,
            yf,
            BATCH,
            steps,
            setting["chunk_steps"],
        )
        seconds = time.perf_counter() - start
        _, per_turn, _ = paired_ratio(timers, "control", "qat")
        run = {
            "seed": fseed,
            "control_top1": top1(control, xt, yt),
            "qat_top1": top1(qat, xt, yt),
            "step_ratio": round(per_turn, 3),
            "finetune_seconds_both": round(seconds, 1),
        }
        run["delta_points"] = round(run["qat_top1"] - run["control_top1"], 2)
        runs.append(run)
        print(
            f"{kind} seed {fseed}: QAT {run['qat_top1']:.2f} vs control "
            f"{run['control_top1']:.2f} ({run['delta_points']:+.2f})"
        )
        if len(runs) == 1:
            first_qat = qat
    out["runs"] = runs
    out["qat_minus_control_points"] = round(
        float(np.mean([r["delta_points"] for r in runs])), 2
    )
    out["unchanged_float_model"] = all(
        np.array_equal(a, b)
        for a, b in zip(float_weights, fmodel.get_weights())
    )

    start = time.perf_counter()
    out["onnx"] = {}
    for label, model in (
        ("float32", fmodel),
        (f"ptq_{QAT_CALIBRATOR}", ptq_models[QAT_CALIBRATOR]),
        ("qat", first_qat),
    ):
        path = os.path.join(directory, f"{kind}_{label}.onnx")
        out["onnx"][label] = _export(model, path, xt, yt)
        print(f"{kind} {label} ONNX: {out['onnx'][label]}")
    out["seconds"]["onnx_exports"] = round(time.perf_counter() - start, 1)
    out["seconds"]["total"] = round(time.perf_counter() - clock, 1)
    return out


def verdicts(run):
    """{goal: (pass, text)} for one model's figures."""
    delta = run["qat_minus_control_points"]
    limit = GOALS["qat_minus_control_points"]
    found = {
        "qat_vs_control": (
            delta >= limit,
            f"QAT - control: {delta:+.2f} point (mean of "
            f"{len(run['runs'])} seed(s); goal >= {limit:+.1f})",
        )
    }
    for label, row in run["onnx"].items():
        agreement = row["top1_agreement_percent"]
        found[f"onnx_agreement_{label}"] = (
            agreement >= GOALS["min_agreement_percent"],
            f"{label} ONNX top-1 agreement {agreement:.2f}% on "
            f"{row['samples']} test images (goal >= "
            f"{GOALS['min_agreement_percent']}%)",
        )
    return found


def _markdown(results):
    runs = results["models"]
    first = next(iter(runs.values()))["setting"]
    intro = (
        f"Fashion-MNIST images read as 28 time steps of 28 features (the "
        f"rows). Each model: Dense({PROJECTION}, relu) on every row, a "
        f"recurrent layer of {UNITS} units ({UNITS} per direction for "
        f"the bidirectional one), Dense(10) logits; trained "
        f"{first['epochs']} epochs in float32 on {first['train_images']:,} "
        f"training images (Adam 1e-3, batch {BATCH}); top-1 on "
        f"{first['test_images']:,} test images. PTQ: `quantize_model` + "
        f"`calibrate` on {first['calib_images']:,} training images. QAT: "
        f"the {QAT_CALIBRATOR}-calibrated model fine-tuned one epoch (Adam, "
        "cosine decay from 1e-4); the float32 control: the float model "
        "fine-tuned the same epoch on the same batches in the same order; "
        f"mean over {first['seeds']} batch order(s). ONNX: `export_onnx` "
        "with every test image as `verify_data`; ONNX Runtime with graph "
        "optimizations off against Keras (agreement), and its own top-1. "
        "The recurrent layers run in float (TensorRT builds an ONNX "
        "LSTM/GRU op's matmuls from float inputs; see "
        "[Export](export.md#recurrent-layers)): only the projection and "
        "the head are INT8."
    )
    rows = []
    for kind, r in runs.items():
        rows.append(
            (
                kind,
                f"{r['params']:,}",
                f"{r['float32_top1']:.2f}",
                " / ".join(
                    f"{r['ptq'][m]['test_top1']:.2f}" for m in CALIBRATORS
                ),
                " / ".join(f"{x['control_top1']:.2f}" for x in r["runs"]),
                " / ".join(f"{x['qat_top1']:.2f}" for x in r["runs"]),
                f"{r['qat_minus_control_points']:+.2f}",
                f"{np.median([x['step_ratio'] for x in r['runs']]):.2f}x",
            )
        )
    table = markdown_table(
        (
            "model",
            "weights",
            "float32 top-1 %",
            "PTQ " + " / ".join(CALIBRATORS) + " %",
            "control % (per seed)",
            "QAT % (per seed)",
            "QAT - control (mean)",
            "QAT step / control",
        ),
        rows,
    )
    onnx_rows = []
    for kind, r in runs.items():
        for label, o in r["onnx"].items():
            onnx_rows.append(
                (
                    kind,
                    label,
                    f"{o['top1_agreement_percent']:.2f}",
                    f"{o['rel_l2']:.2e}",
                    f"{o['max_abs_diff']:.3g}",
                    f"{o['ort_top1']:.2f}",
                    f"{o['ort_optimized_top1_agreement_percent']:.2f}",
                    "PASS" if o["lint_ok"] else "FAIL",
                    o["qdq_nodes"],
                    f"{o['weighted_ops_quantized']} / {o['weighted_ops']}",
                    ", ".join(o["recurrent_onnx_ops"]),
                )
            )
    onnx_table = markdown_table(
        (
            "model",
            "export",
            "ORT agreement %",
            "rel. L2",
            "max abs diff",
            "ORT top-1 %",
            "ORT default-opt agreement %",
            "lint",
            "Q/DQ nodes",
            "weighted ops with Q/DQ",
            "recurrent ONNX op",
        ),
        onnx_rows,
    )
    float_rows = [
        (
            kind,
            ", ".join(r["quantized_layers"]),
            ", ".join(f"{f['path']} ({f['type']})" for f in r["float_layers"]),
        )
        for kind, r in runs.items()
    ]
    float_table = markdown_table(
        ("model", "INT8 layers", "float layers (`quantization_report`)"),
        float_rows,
    )
    goal_rows = [
        (kind, goal, "PASS" if ok else "FAIL", text)
        for kind, r in runs.items()
        for goal, (ok, text) in verdicts(r).items()
    ]
    goals = markdown_table(("model", "goal", "result", "measured"), goal_rows)
    seconds = ", ".join(
        f"{kind} {r['seconds']['total']:.0f} s" for kind, r in runs.items()
    )
    return (
        intro
        + "\n\n"
        + table
        + "\n\nONNX exports (the QAT row is the first seed's model):\n\n"
        + onnx_table
        + "\n\nWhat is quantized:\n\n"
        + float_table
        + "\n\nGoals (issue 23), as measured:\n\n"
        + goals
        + f"\n\nRun time: {seconds}."
    )


def main():
    parser = bench_parser(
        __doc__,
        f"smoke run: {QUICK['train_images']} training and "
        f"{QUICK['test_images']} test images, {QUICK['epochs']} epoch, "
        f"{QUICK['seeds']} seed",
    )
    parser.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--seeds", type=int, default=None, help="fine-tune seeds"
    )
    args = parser.parse_args()
    results = {"models": {}, "goals": GOALS}
    with tempfile.TemporaryDirectory() as folder:
        for kind in args.models:
            results["models"][kind] = measure(
                kind, folder, args.quick, args.seed, args.seeds
            )
    results["verdicts"] = {
        kind: verdicts_json(verdicts(run))
        for kind, run in results["models"].items()
    }
    write_results("sequence", results, _markdown(results), quick=args.quick)


if __name__ == "__main__":
    main()

"""`layer_sensitivity` and `auto_quantize` on networks trained on real data.

Issue 25: does the per-layer search keep a trained network within an
accuracy budget while quantizing most of its work?

- data: Fashion-MNIST (Debian's `dataset-fashion-mnist`). The last
  `VALIDATION` training images are held out of training: `auto_quantize`
  measures its metric on them (`eval_data`), never on the test set; the
  first `CALIBRATION` training images calibrate and score
  (`calibration_batches` 16 of 64, scoring on the first 4 batches);
- models: `keras_mp.reference.reference_cnn(width=16)` (28x28, 3 epochs),
  and `keras.applications` MobileNetV2 (alpha 0.35, 2 epochs) and
  EfficientNetB0 (1 epoch) at 32x32, built and trained as
  `bench_trained_parity.py` does (BatchNorm momentum 0.9, Adam with cosine
  decay from 2e-3); the ViT of `keras-mp demo` (keras-hub `ViTBackbone`,
  `keras_mp.cli.demo_vit.vit_classifier`, 3 epochs); float32 policy,
  logits out;
- baselines: all-INT8 and all-FP8 PTQ (`quantize_model` + `calibrate`,
  method "auto", on the same calibration images);
- `auto_quantize(precisions=("int8", "float8", "float"), cost="latency",
  gpu="H100", max_drop=...)`, then `cost="bits"` as a second row;
- reported per model: float32, PTQ and auto-quantized top-1 on the 10,000
  test images; the choice counts, fraction of FLOPs quantized, predicted
  H100 speed-up over float16 (chosen, all INT8, all FP8), effective
  weight bits, search wall time and passes; the top 5 of the sensitivity
  ranking. Goals (PASS or FAIL as measured): auto-quantized test top-1
  within `max_drop` of float32, and >= 80% of the FLOPs quantized;
- with `--modelopt VENV`: ModelOpt AutoQuantize on the same float model
  (its ONNX through onnx2torch, `peers/modelopt_autoquant.py`), the same
  calibration and test images, at effective bits 8 and at keras_mp's.

`placement.MIN_GEMM_DIM` stays at its default: layers too small for
Tensor Cores are not quantized.

    python benchmarks/bench_sensitivity.py [--quick] [--models NAME ...]
        [--max-drop 0.005] [--modelopt VENV] [--merge]
"""

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    bench_parser,
    command_line,
    markdown_table,
    write_results,
)
from bench_trained_parity import MODELS as APPLICATIONS  # noqa: E402
from bench_trained_parity import build, load_data, train  # noqa: E402

import keras_mp  # noqa: E402
from keras_mp.datasets import shuffled_batches  # noqa: E402
from keras_mp.reference import compile_classifier, reference_cnn  # noqa: E402

MIN_QUANTIZED_FLOPS = 0.8
VALIDATION = 5000
CALIBRATION = 1024
EVAL_BATCH = 500
GPU = "H100"
TOP = 5
QUICK = {"train_images": 16384, "test_images": 2000, "validation": 2000}
MODELS = ("reference_cnn", *APPLICATIONS, "vit")
VIT_EPOCHS = 3
HERE = os.path.dirname(os.path.abspath(__file__))

INTRO = (
    "`keras_mp.auto_quantize` (INT8, FP8 or float16 per layer, least "
    "predicted H100 latency within `max_drop` of float on a validation "
    "slice of the training images) against all-INT8 and all-FP8 PTQ "
    "(`calibrate` method auto), on networks trained in float32 on "
    "Fashion-MNIST: the reference CNN (width 16) and `keras.applications` "
    "MobileNetV2 (alpha 0.35) and EfficientNetB0 at 32x32, and the ViT of "
    "`keras-mp demo`. Top-1 on the "
    "test images, which the search never sees. Predicted speed-ups come "
    "from the cost model (`docs/latency_model.md`), not a GPU. Goals: "
    "auto-quantized test top-1 within `max_drop` of float32, >= 80% of "
    "the FLOPs quantized."
)


def _data(name, quick):
    """`(x_train, y_train), (x_val, y_val), (x_test, y_test)`."""
    train_images = QUICK["train_images"] if quick else 60000
    test_images = QUICK["test_images"] if quick else 10000
    validation = QUICK["validation"] if quick else VALIDATION
    if name in ("reference_cnn", "vit"):
        (x, y), (xt, yt) = keras_mp.datasets.load_fashion_mnist()
        x, y, xt, yt = x[:train_images], y[:train_images], xt, yt
        xt, yt = xt[:test_images], yt[:test_images]
    else:
        (x, y), (xt, yt) = load_data(
            APPLICATIONS[name], train_images, test_images
        )
    held = len(x) - validation
    return (x[:held], y[:held]), (x[held:], y[held:]), (xt, yt)


def _trained(name, x, y, quick):
    """The float32 model `name`, trained; and its epochs."""
    if name == "reference_cnn":
        keras.utils.set_random_seed(0)
        model = compile_classifier(reference_cnn(x.shape[1:], width=16))
        epochs = 1 if quick else 3
        model.fit(shuffled_batches(x, y, 128), epochs=epochs, verbose=2)
        return model, epochs
    if name == "vit":
        from keras_mp.cli import demo_vit

        keras.utils.set_random_seed(0)
        model = compile_classifier(
            demo_vit.vit_classifier(x.shape[1:]),
            learning_rate=demo_vit.TRAIN_LEARNING_RATE,
        )
        epochs = 1 if quick else VIT_EPOCHS
        model.fit(shuffled_batches(x, y, 128), epochs=epochs, verbose=2)
        return model, epochs
    spec = APPLICATIONS[name]
    epochs = 1 if quick else spec.epochs
    return train(build(spec, x.shape[1:]), x, y, epochs), epochs


def _top1(model, x, y):
    logits = model.predict(x, batch_size=EVAL_BATCH, verbose=0)
    return float(np.mean(np.argmax(logits, -1) == y))


def _ptq(model, precision, x_cal):
    qmodel = keras_mp.quantize_model(model, precision=precision)
    keras_mp.calibrate(qmodel, x_cal, method="auto", verbose=0)
    return qmodel


def _counts(report):
    counts = {}
    for choice in report.rows:
        counts[choice.precision] = counts.get(choice.precision, 0) + 1
    return dict(sorted(counts.items()))


def _error(error):
    tail = traceback.format_exception(error)[-6:]
    return {"error": f"{type(error).__name__}: {error}", "traceback": tail}


def _search(model, cost, data, xt, yt, max_drop):
    """One `auto_quantize` run and the test top-1 of its model."""
    (xc, yc), (xv, yv) = data
    row = {"cost": cost}
    try:
        qmodel, report = keras_mp.auto_quantize(
            model,
            xc,
            yc,
            max_drop=max_drop,
            precisions=("int8", "float8", "float"),
            cost=cost,
            gpu=GPU,
            eval_data=xv,
            eval_labels=yv,
            verbose=0,
        )
    except Exception as error:  # a finding, recorded in the table
        traceback.print_exc()
        row.update(_error(error))
        return row, None
    print(report, flush=True)
    row.update(
        test_top1=_top1(qmodel, xt, yt),
        choices=_counts(report),
        val_top1_float=report.metric_float,
        val_top1=report.metric,
        val_drop=report.drop,
        quantized_flops=report.quantized_flops,
        effective_bits=report.effective_bits,
        predicted=report.predicted,
        speedup_over_fp16=report.speedup_over_fp16,
        configurations_measured=len(report.tried),
        passes=report.passes,
        seconds=report.seconds,
        report=report.to_dict(),
    )
    return row, report


def _ranking(report):
    rows = []
    for row in report.sensitivity.rows[:TOP]:
        rows.append(
            {
                "name": row.name,
                "type": row.layer_type,
                "scores": row.scores,
                "formats": row.formats,
                "flops": None if row.work is None else float(row.work.flops),
            }
        )
    return rows


def _modelopt(name, model, calibration, test, bits, venv):
    """ModelOpt AutoQuantize (PyTorch, through onnx2torch:
    `peers/modelopt_autoquant.py` in its own venv) on the same float
    model, calibration and test images, at effective bits 8.0 (every
    searched layer INT8 or FP8) and at keras_mp's chosen effective bits."""
    (xc, yc), (xt, yt) = calibration, test
    with tempfile.TemporaryDirectory() as tmp:
        onnx_path = os.path.join(tmp, f"{name}.onnx")
        keras_mp.export_onnx(model, onnx_path, verify_data=xt[:256])
        data = os.path.join(tmp, "data.npz")
        np.savez(data, x_calib=xc, y_calib=yc, x_eval=xt, y_eval=yt)
        out = os.path.join(tmp, "out.json")
        targets = sorted({8.0, *(round(b, 2) for b in bits)})
        command = [
            os.path.join(venv, "bin", "python"),
            os.path.join(HERE, "peers", "modelopt_autoquant.py"),
            "--onnx", onnx_path, "--data", data, "--out", out,
            "--name", name,
            "--effective-bits", *[str(b) for b in targets],
        ]  # fmt: skip
        run = subprocess.run(command, capture_output=True, text=True)
        if run.returncode != 0 or not os.path.exists(out):
            return {"error": (run.stderr or run.stdout)[-2000:]}
        with open(out) as f:
            found = json.load(f)
    return {
        "float_top1": found.get("float_top1"),
        "search": {
            k: v
            for k, v in (found.get("search") or {}).items()
            if k in ("seconds", "forward_passes", "backward_passes", "ok")
        },
        "targets": [
            {
                k: t.get(k)
                for k in (
                    "effective_bits_target",
                    "effective_bits",
                    "formats_summary",
                    "top1",
                    "top1_agreement_vs_float",
                )
            }
            for t in found.get("targets", [])
        ],
        "errors": found.get("errors") or {},
        "notes": found.get("notes") or [],
    }


def measure(name, quick, max_drop, costs, modelopt=None):
    """Trains `name`, quantizes it every way, returns one result dict."""
    (x, y), (xv, yv), (xt, yt) = _data(name, quick)
    start = time.perf_counter()
    model, epochs = _trained(name, x, y, quick)
    out = {
        "model": name,
        "params": int(model.count_params()),
        "train_images": len(x),
        "epochs": epochs,
        "train_seconds": time.perf_counter() - start,
        "validation_images": len(xv),
        "calibration_images": CALIBRATION,
        "test_images": len(xt),
        "float_top1": _top1(model, xt, yt),
    }
    xc, yc = x[:CALIBRATION], y[:CALIBRATION]
    for precision in ("int8", "float8"):
        try:
            qmodel = _ptq(model, precision, xc)
            out[f"{precision}_top1"] = _top1(qmodel, xt, yt)
        except Exception as error:  # a finding, recorded in the table
            traceback.print_exc()
            out[f"{precision}_error"] = _error(error)["error"]
    out["searches"] = []
    for cost in costs:
        row, report = _search(
            model, cost, ((xc, yc), (xv, yv)), xt, yt, max_drop
        )
        if "test_top1" in row:
            row["test_drop"] = out["float_top1"] - row["test_top1"]
            row["goal_drop"] = row["test_drop"] <= max_drop
            row["goal_flops"] = row["quantized_flops"] >= MIN_QUANTIZED_FLOPS
        if report is not None and "ranking" not in out:
            out["ranking"] = _ranking(report)
        out["searches"].append(row)
    if modelopt:
        bits = [
            r["effective_bits"] for r in out["searches"] if "error" not in r
        ]
        try:
            out["modelopt"] = _modelopt(
                name, model, (xc, yc), (xt, yt), bits, modelopt
            )
        except Exception as error:  # a finding, recorded in the table
            traceback.print_exc()
            out["modelopt"] = _error(error)
    return out


def _pct(value):
    return "-" if value is None else f"{100 * value:.2f}"


def _verdict(ok):
    return "-" if ok is None else ("PASS" if ok else "FAIL")


def _tables(results, max_drop):
    trained = markdown_table(
        [
            "model",
            "parameters",
            "train images x epochs",
            "train s",
            "float32 top-1 %",
            "all-INT8 PTQ top-1 %",
            "all-FP8 PTQ top-1 %",
        ],
        [
            [
                r["model"],
                f"{r['params']:,}",
                f"{r['train_images']:,} x {r['epochs']}",
                f"{r['train_seconds']:.0f}",
                _pct(r["float_top1"]),
                _pct(r.get("int8_top1")) + _note(r.get("int8_error")),
                # results recorded before the vocabulary say "fp8"
                _pct(r.get("float8_top1", r.get("fp8_top1")))
                + _note(r.get("float8_error", r.get("fp8_error"))),
            ]
            for r in results
        ],
    )
    body = []
    for r in results:
        for s in r["searches"]:
            if "error" in s:
                body.append(
                    [r["model"], s["cost"], f"error: `{s['error']}`"]
                    + ["-"] * 12
                )
                continue
            p = s["predicted"]
            fp16 = p.get("float", p.get("float16"))  # recorded: "float16"
            body.append(
                [
                    r["model"],
                    s["cost"],
                    _pct(s["test_top1"]),
                    f"{100 * s['test_drop']:+.2f}",
                    _verdict(s["goal_drop"]),
                    f"{100 * s['val_drop']:+.2f}",
                    ", ".join(f"{k} {v}" for k, v in s["choices"].items()),
                    f"{100 * s['quantized_flops']:.1f}",
                    _verdict(s["goal_flops"]),
                    f"{fp16 / p['chosen']:.2f}",
                    f"{fp16 / p['all int8']:.2f}",
                    f"{fp16 / p['all fp8']:.2f}",
                    f"{s['effective_bits']:.2f}",
                    f"{s['seconds']:.0f}",
                    f"{s['configurations_measured']}; "
                    + ", ".join(f"{k} {v}" for k, v in s["passes"].items()),
                ]
            )
    search = markdown_table(
        [
            "model",
            "cost",
            "auto top-1 %",
            "drop vs float32 (points)",
            f"goal drop <= {100 * max_drop:g}",
            "validation drop (points)",
            "choices (layers)",
            "FLOPs quantized %",
            f"goal >= {100 * MIN_QUANTIZED_FLOPS:.0f}%",
            "H100 speed-up over FP16: chosen",
            "all INT8",
            "all FP8",
            "effective bits",
            "search s",
            "configurations measured; passes",
        ],
        body,
    )
    ranking = []
    for r in results:
        for i, row in enumerate(r.get("ranking", []), 1):
            ranking.append(
                [
                    r["model"],
                    i,
                    f"`{row['name']}`",
                    row["type"],
                    ", ".join(f"{k} {v:.3g}" for k, v in row["scores"].items()),
                    "-" if row["flops"] is None else f"{row['flops']:.3g}",
                ]
            )
    top = markdown_table(
        ["model", "rank", "layer", "type", "scores", "FLOPs"], ranking
    )
    return (
        trained
        + "\n\n"
        + search
        + f"\n\nThe {TOP} most sensitive layers (gradient scores, "
        "`report.sensitivity.rows`):\n\n" + top + _modelopt_table(results)
    )


def _modelopt_table(results):
    """ModelOpt AutoQuantize's rows, for the models it ran on."""
    rows = []
    for r in results:
        mo = r.get("modelopt")
        if mo is None:
            continue
        if "error" in mo:
            error = f"error: `{mo['error'][-300:]}`"
            rows.append([r["model"], error] + ["-"] * 5)
            continue
        search = mo.get("search", {})
        for t in mo.get("targets", []):
            rows.append(
                [
                    r["model"],
                    f"{t['effective_bits_target']:g}",
                    "-"
                    if t["effective_bits"] is None
                    else f"{t['effective_bits']:.2f}",
                    ", ".join(
                        f"{k} {v}"
                        for k, v in (t["formats_summary"] or {}).items()
                    ),
                    "-" if t["top1"] is None else f"{t['top1']:.2f}",
                    "-"
                    if t["top1"] is None or mo["float_top1"] is None
                    else f"{t['top1'] - mo['float_top1']:+.2f}",
                    f"{search.get('seconds', '-')} s; forward "
                    f"{search.get('forward_passes', '-')}, forward+backward "
                    f"{search.get('backward_passes', '-')}",
                ]
            )
    if not rows:
        return ""
    return (
        "\n\nModelOpt AutoQuantize (`mtq.auto_quantize`, gradient scores, "
        "INT8_DEFAULT_CFG and FP8_DEFAULT_CFG) on the same float model "
        "(keras_mp's ONNX, converted with onnx2torch: "
        "`benchmarks/peers/modelopt_autoquant.py`), the same calibration "
        "images and the same test images, at effective bits 8 (every "
        "searched layer INT8 or FP8) and at keras_mp's chosen effective "
        "bits. ModelOpt constrains effective bits, not accuracy; its "
        "float top-1 is the converted torch model's. It searches Linear "
        "and Conv layers only (not the attention matmuls).\n\n"
        + markdown_table(
            [
                "model",
                "effective bits asked",
                "effective bits",
                "formats (layers)",
                "top-1 %",
                "vs its float (points)",
                "search",
            ],
            rows,
        )
    )


def _note(error):
    return f" (error: `{error}`)" if error else ""


def _summary(results, max_drop):
    latency = [
        s
        for r in results
        for s in r["searches"]
        if s["cost"] == "latency" and "error" not in s
    ]
    both = sum(bool(s["goal_drop"] and s["goal_flops"]) for s in latency)
    failed = sum("error" in s for r in results for s in r["searches"])
    text = (
        f"{len(results)} trained models, max_drop {max_drop} "
        f"({100 * max_drop:g} point): {both}/{len(latency)} latency "
        "searches meet both goals"
    )
    if failed:
        text += f"; {failed} search(es) raised an error (table)"
    parts = []
    for r in results:
        s = r["searches"][0]
        if "int8_top1" not in r or "test_top1" not in s:
            continue
        parts.append(
            f"{r['model']} "
            f"{100 * (r['float_top1'] - r['int8_top1']):+.2f} all-INT8, "
            f"{100 * s['test_drop']:+.2f} auto ({s['cost']})"
        )
    if parts:
        text += (
            ". Test top-1 drop from float32, points (+ = lower): "
            + "; ".join(parts)
        )
    return text + "."


def _commands(results):
    """Which command measured which rows, when `--merge` runs differ."""
    by = {}
    for r in results:
        by.setdefault(r.get("command", "?"), []).append(r["model"])
    if len(by) < 2:
        return ""
    lines = [f"- {', '.join(models)}: `{c}`" for c, models in by.items()]
    return "Rows measured by:\n\n" + "\n".join(lines) + "\n\n"


def main():
    parser = bench_parser(
        __doc__,
        f"smoke run: {QUICK['train_images']} training images, one "
        f"epoch, {QUICK['test_images']} test images",
    )
    parser.add_argument("--models", nargs="+", choices=MODELS)
    parser.add_argument(
        "--max-drop",
        type=float,
        default=0.005,
        help="auto_quantize's budget, top-1 as a fraction (default 0.005)",
    )
    parser.add_argument(
        "--no-bits",
        action="store_true",
        help="skip the cost='bits' search",
    )
    parser.add_argument(
        "--modelopt",
        metavar="VENV",
        help="also run ModelOpt AutoQuantize in this venv (see "
        "benchmarks/peers/modelopt_autoquant.py --setup-venv)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the other models' rows of the existing results",
    )
    args = parser.parse_args()
    costs = ("latency",) if args.no_bits else ("latency", "bits")
    results = []
    if args.merge and not args.models:
        parser.error("--merge needs --models (the rows to measure again)")
    if args.merge:
        with open(os.path.join(HERE, "results", "sensitivity.json")) as f:
            results = json.load(f)["models"]  # replaced as each is measured
    for name in args.models or MODELS:
        start = time.perf_counter()
        row = measure(name, args.quick, args.max_drop, costs, args.modelopt)
        row["seconds"] = time.perf_counter() - start
        row["command"] = command_line()  # rows of --merge runs differ
        results = [r for r in results if r["model"] != name] + [row]
        print(f"{name}: {row['seconds']:.0f} s", flush=True)
        keras.backend.clear_session()
        # Written after every model: a long run keeps what it measured.
        results.sort(key=lambda r: MODELS.index(r["model"]))
        summary = _summary(results, args.max_drop)
        markdown = (
            INTRO
            + "\n\n"
            + _commands(results)
            + summary
            + "\n\n"
            + _tables(results, args.max_drop)
        )
        write_results(
            "sensitivity",
            {
                "summary": summary,
                "goals": {
                    "max_drop": args.max_drop,
                    "min_quantized_flops": MIN_QUANTIZED_FLOPS,
                },
                "gpu": GPU,
                "models": results,
            },
            markdown,
            quick=args.quick,
        )


if __name__ == "__main__":
    main()

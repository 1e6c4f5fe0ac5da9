"""A small ViT on real Fashion-MNIST: float32, INT8 PTQ, INT8 QAT and a
float32 control given the same extra epoch, ONNX parity and coverage
(issue 16, item 7).

- data: Fashion-MNIST (Debian's `dataset-fashion-mnist`), 60,000 training
  and 10,000 test images, 28x28x1 in [0, 1];
- model: `keras_mp.cli.demo_vit.vit_classifier`, the demo's ViT: a keras-hub
  `ViTBackbone` (patch 7, so 16 patches and a class token; 2 layers,
  hidden 64, 4 heads, MLP 128) with a GlobalAveragePooling1D + Dense(10)
  logits head, float32, trained with Adam 1e-3, batch 128;
- PTQ: `quantize_model` (in place, inside the keras-hub backbone) +
  `calibrate` on 2,048 training images with each calibrator; QAT: the
  percentile-calibrated model fine-tuned one epoch with
  `keras_mp.reference.fine_tune` (Adam, cosine-decayed from 1e-4), and the
  float32 control: the float model fine-tuned the same epoch the same way;
- each model is exported with `export_onnx` (which refuses a TensorRT
  contract violation) and linted with `check_tensorrt`; coverage: weighted
  ops (Conv, MatMul, Gemm) with DequantizeLinear on both inputs, and the
  attention matmuls among them (a MatMul of two run-time tensors:
  Q x K and softmax x V; `demo_vit.attention_coverage`); parity: all test
  images through ONNX Runtime with graph optimizations off, top-1
  agreement with Keras and ORT's own test top-1;
- goals (each seed, PASS or FAIL as measured): QAT >= control - 0.3
  point; every PTQ calibrator >= float32 - 1.0 point; every INT8 export
  lint-clean with every weighted op and every attention matmul behind
  Q/DQ; ORT top-1 agreement >= 99.5%.

    python benchmarks/bench_vit.py [--quick] [--seeds N]
"""

import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
from _common import (  # noqa: E402
    bench_parser,
    markdown_table,
    verdicts_json,
    write_results,
)

from keras_mp import datasets  # noqa: E402
from keras_mp.cli import demo_vit  # noqa: E402

CALIBRATORS = ("max", "percentile", "entropy", "mse")
EPOCHS = 5
QUICK = {"train_images": 4096, "test_images": 2000, "epochs": 1}
GOALS = {
    "qat_minus_control_points": -0.3,
    "ptq_minus_float32_points": -1.0,
    "min_agreement_percent": 99.5,
}


def measure(seed, directory, quick=False):
    """One seed of the benchmark: `demo_vit.run_vit` with every calibrator.

    Returns:
        dict: `seed`, `epochs`, `train_images`, `test_images`, `seconds`,
        and `run_vit`'s figures (`params`, `train_seconds`, `qat_seconds`,
        `control_seconds`, `methods`).

    Raises:
        ImportError: keras-hub is not installed.
        DatasetError: Fashion-MNIST is not installed.
    """
    if demo_vit.keras_hub_or_none() is None:
        raise ImportError(demo_vit.INSTALL_HINT)
    (x, y), (xt, yt) = datasets.load_fashion_mnist()
    epochs = EPOCHS
    if quick:
        x, y = x[: QUICK["train_images"]], y[: QUICK["train_images"]]
        xt, yt = xt[: QUICK["test_images"]], yt[: QUICK["test_images"]]
        epochs = QUICK["epochs"]
    start = time.perf_counter()
    run = demo_vit.run_vit(
        x,
        y,
        xt,
        yt,
        directory,
        epochs,
        ptq_methods=CALIBRATORS,
        seed=seed,
    )
    keras.backend.clear_session()
    return {
        "seed": seed,
        "epochs": epochs,
        "train_images": len(x),
        "test_images": len(xt),
        "seconds": round(time.perf_counter() - start, 1),
        **run,
    }


def verdicts(run):
    """The goals of one seed: name -> (pass, the figures judged)."""
    m = run["methods"]
    fp, control = m["float32"]["test_top1"], m["float32_control"]["test_top1"]
    int8 = [label for label in m if not label.startswith("float32")]
    qat_gap = round(m["qat"]["test_top1"] - control, 2)
    ptq_gaps = {
        label: round(m[label]["test_top1"] - fp, 2)
        for label in int8
        if label.startswith("ptq_")
    }
    covered = {
        label: (
            m[label]["tensorrt_lint"] == "clean"
            and m[label]["weighted_quantized"] == m[label]["weighted_ops"]
            and m[label]["attention_quantized"]
            == m[label]["attention_matmuls"]
            > 0
        )
        for label in int8
    }
    agreement = {label: r["parity_top1_agreement"] for label, r in m.items()}
    return {
        "qat_vs_control": (
            qat_gap >= GOALS["qat_minus_control_points"],
            f"QAT - control: {qat_gap:+.2f} point",
        ),
        "ptq_vs_float32": (
            min(ptq_gaps.values()) >= GOALS["ptq_minus_float32_points"],
            "PTQ - float32: "
            + ", ".join(f"{k[4:]} {v:+.2f}" for k, v in ptq_gaps.items()),
        ),
        "coverage_and_lint": (
            all(covered.values()),
            "INT8 exports lint-clean, all weighted ops and attention "
            "matmuls behind Q/DQ: "
            + ", ".join(k for k, ok in covered.items() if ok),
        ),
        "onnx_parity": (
            min(agreement.values()) >= GOALS["min_agreement_percent"],
            f"lowest ORT top-1 agreement {min(agreement.values()):.2f}%",
        ),
    }


def _markdown(runs):
    first = runs[0]
    intro = (
        f"A keras-hub `ViTBackbone` (patch 7 on 28x28: 16 patches and a "
        f"class token; 2 layers, hidden 64, 4 heads, MLP 128; "
        f"{first['params']:,} weights) with a pooled Dense(10) head, trained "
        f"{first['epochs']} epoch(s) in float32 on {first['train_images']:,} "
        f"Fashion-MNIST images (Adam 1e-3, batch 128); tested on "
        f"{first['test_images']:,}. PTQ: `quantize_model` + `calibrate` on "
        "2,048 training images. QAT: percentile calibration, then one epoch "
        "of `fine_tune` (cosine-decayed from 1e-4); `float32_control`: the "
        "float model given the same epoch. ORT: ONNX Runtime, graph "
        "optimizations off, every test image. Weighted ops: Conv, MatMul, "
        "Gemm with DequantizeLinear on both inputs; attention matmuls: "
        "MatMuls of two run-time tensors (Q x K, softmax x V)."
    )
    header = [
        "seed",
        "model",
        "test top-1 %",
        "vs float32",
        "lint",
        "Q/DQ nodes",
        "weighted ops with Q/DQ",
        "attention matmuls with Q/DQ",
        "ORT top-1 %",
        "ORT agreement %",
        "max abs logit diff",
    ]
    body, goals = [], []
    for run in runs:
        fp = run["methods"]["float32"]["test_top1"]
        for label, m in run["methods"].items():
            body.append(
                [
                    run["seed"],
                    label,
                    f"{m['test_top1']:.2f}",
                    f"{m['test_top1'] - fp:+.2f}",
                    m["tensorrt_lint"],
                    m["qdq_nodes"],
                    f"{m['weighted_quantized']} / {m['weighted_ops']}",
                    f"{m['attention_quantized']} / {m['attention_matmuls']}",
                    f"{m['ort_test_top1']:.2f}",
                    f"{m['parity_top1_agreement']:.2f}",
                    f"{m['parity_max_abs_diff']:.3g}",
                ]
            )
        for name, (ok, text) in verdicts(run).items():
            goals.append(
                f"- seed {run['seed']}, {name}: "
                f"{'PASS' if ok else 'FAIL'} ({text})"
            )
        goals.append(
            f"- seed {run['seed']}: {run['seconds']} s in all (float "
            f"training {run['train_seconds']} s, QAT {run['qat_seconds']} s, "
            f"control {run['control_seconds']} s)"
        )
    return "\n\n".join(
        [intro, markdown_table(header, body), "Goals:\n\n" + "\n".join(goals)]
    )


def main():
    parser = bench_parser(
        __doc__,
        f"smoke run: {QUICK['train_images']} training and "
        f"{QUICK['test_images']} test images, {QUICK['epochs']} epoch",
    )
    parser.add_argument("--seeds", type=int, default=2, help="runs (seeds)")
    args = parser.parse_args()
    if demo_vit.keras_hub_or_none() is None:
        parser.error(demo_vit.INSTALL_HINT)
    if not datasets.fashion_mnist_available():
        parser.error(
            "Fashion-MNIST is not installed: `apt-get install "
            "dataset-fashion-mnist`."
        )
    runs = []
    with tempfile.TemporaryDirectory() as directory:
        for seed in range(args.seeds):
            runs.append(measure(seed, directory, quick=args.quick))
            print(f"seed {seed}: {runs[-1]['seconds']} s", flush=True)
    results = {
        "goals": GOALS,
        "runs": runs,
        "verdicts": [verdicts_json(verdicts(run), "figures") for run in runs],
    }
    write_results("vit", results, _markdown(runs), quick=args.quick)


if __name__ == "__main__":
    main()

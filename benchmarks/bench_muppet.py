"""MuPPET on Fashion-MNIST: float32 vs adaptive switching vs fixed schedule.

Three runs from the same initial weights, the same data order and the same
epoch budget: a plain float32 model, a `fixed_point_model` copy with
MuPPET's adaptive `PrecisionSwitching()` (schedule 8, 12, 14, 16 bits,
float32; r=3, gamma=2), and one with a fixed epoch schedule. An "epoch"
here is `--samples-per-epoch` training images (a slice of a seeded
permutation of the 60,000), so the policy sees enough epochs in a CPU
budget. The runs advance in lockstep, one epoch each in turn, so load from
other processes hits all three alike.

Reported: final test accuracy (10,000 real test images), switch epochs,
per-epoch wall time relative to float32, and the cost-model GPU speed-up
estimate (`keras_mp.muppet.estimate_speedup`). On this CPU fixed point is
emulated in float32 arithmetic and runs *slower* than float32: the time
ratio measures emulation overhead, never a speed-up.

Usage:

    python benchmarks/bench_muppet.py            # full run, ~10 min on 2 cores
    python benchmarks/bench_muppet.py --quick    # smoke run, ~1 min
    python benchmarks/bench_muppet.py --model mobilenetv2   # ~15 min

`--model mobilenetv2` runs `keras.applications.MobileNetV2` (alpha 0.35,
32x32 padded images) in float32 and with adaptive switching only, and
writes its own part of the results, keeping the CNN's.
"""

import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _common import RESULTS, bench_parser  # noqa: E402

from keras_mp.datasets import load_fashion_mnist  # noqa: E402
from keras_mp.io import atomic_write_text  # noqa: E402
from keras_mp.muppet import (  # noqa: E402
    GPU_THROUGHPUT,
    PrecisionSwitching,
    estimate_speedup,
    fixed_point_model,
    plot_precision,
    set_word_length,
)


def cnn():
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ],
        name="fashion_cnn",
    )


# BatchNormalization momentum for the applications model: with
# keras.applications' own 0.999 the moving statistics of a net trained
# briefly from scratch stay near their initial values (chance accuracy at
# test time; measured in bench_trained_parity.py).
BN_MOMENTUM = 0.9
APPLICATIONS = {"mobilenetv2": "MobileNetV2_0.35"}


def mobilenetv2():
    model = keras.applications.MobileNetV2(
        input_shape=(32, 32, 1),
        alpha=0.35,
        weights=None,
        classes=10,
        classifier_activation=None,
    )
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.momentum = BN_MOMENTUM
    return model


def load_data(args):
    """Fashion-MNIST for `args.model`: 28x28, or zero-padded to 32x32
    (the smallest input MobileNetV2 takes) for the applications model."""
    (x, y), (xt, yt) = load_fashion_mnist()
    if args.quick:
        xt, yt = xt[:2000], yt[:2000]
    if args.model != "cnn":
        pad = ((0, 0), (2, 2), (2, 2), (0, 0))
        x, xt = np.pad(x, pad), np.pad(xt, pad)
    return (x, y), (xt, yt)


def compile_model(model, lr):
    model.compile(
        keras.optimizers.Adam(lr),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def epoch_batches(x, y, samples, epochs, seed):
    """Yields `epochs` slices of `samples` images from seeded permutations."""
    rng = np.random.default_rng(seed)
    order = np.empty(0, "int64")
    for _ in range(epochs):
        while len(order) < samples:
            order = np.concatenate([order, rng.permutation(len(x))])
        idx, order = order[:samples], order[samples:]
        yield x[idx], y[idx]


def fixed_schedule(epochs, stages):
    """Even split of the first 60% of epochs over the fixed-point stages."""
    step = 0.6 * epochs / (stages - 1)
    return tuple(max(i + 1, round(step * (i + 1))) for i in range(stages - 1))


def run(args):
    keras.utils.set_random_seed(args.seed)
    (x, y), (xt, yt) = load_data(args)
    base = cnn() if args.model == "cnn" else mobilenetv2()
    runs = {
        "float32": {"model": keras.models.clone_model(base)},
        "muppet": {
            "callback": PrecisionSwitching(
                resolution=args.resolution, patience=args.patience
            )
        },
        "fixed_schedule": {
            "callback": PrecisionSwitching(
                epoch_schedule=fixed_schedule(args.epochs, 5)
            )
        },
    }
    if args.model != "cnn":
        # One fixed-point run: the MobileNetV2 copy takes minutes to trace.
        del runs["fixed_schedule"]
    runs["float32"]["model"].set_weights(base.get_weights())
    compile_model(runs["float32"]["model"], args.lr)
    for name in [n for n in runs if n != "float32"]:
        runs[name]["model"] = compile_model(
            fixed_point_model(base, seed=args.seed), args.lr
        )
    for r in runs.values():
        r.update(times=[], logs=[])

    data = epoch_batches(x, y, args.samples_per_epoch, args.epochs, args.seed)
    for epoch, (xe, ye) in enumerate(data):
        for r in runs.values():
            callbacks = [r["callback"]] if "callback" in r else []
            start = time.perf_counter()
            hist = r["model"].fit(
                xe,
                ye,
                batch_size=args.batch_size,
                initial_epoch=epoch,
                epochs=epoch + 1,
                verbose=0,
                callbacks=callbacks,
            )
            r["times"].append(time.perf_counter() - start)
            r["logs"].append({k: v[-1] for k, v in hist.history.items()})
        line = "  ".join(
            f"{n}: {r['logs'][-1].get('precision', 32):.0f}b "
            f"{r['times'][-1]:.1f}s"
            for n, r in runs.items()
        )
        print(f"epoch {epoch:2d}  {line}", flush=True)

    float_epoch = statistics.median(runs["float32"]["times"][1:])
    results = {}
    for name, r in runs.items():
        model = r["model"]
        acc = float(model.evaluate(xt, yt, batch_size=512, verbose=0)[1])
        entry = {
            "test_accuracy": acc,
            "median_epoch_seconds": statistics.median(r["times"][1:]),
            "epoch_seconds": r["times"],
            "train_loss": [lg["loss"] for lg in r["logs"]],
        }
        entry["epoch_time_ratio_to_float32"] = (
            entry["median_epoch_seconds"] / float_epoch
        )
        if "callback" in r:
            precisions = [int(lg["precision"]) for lg in r["logs"]]
            set_word_length(model, None)
            entry.update(
                test_accuracy_float32_inference=float(
                    model.evaluate(xt, yt, batch_size=512, verbose=0)[1]
                ),
                precision_per_epoch=precisions,
                switch_epochs=r["callback"].switch_epochs,
                p=[None if np.isnan(lg["p"]) else lg["p"] for lg in r["logs"]],
                T=[lg["T"] for lg in r["logs"]],
                time_ratio_per_precision={
                    str(b): statistics.median(
                        t
                        for i, t in enumerate(r["times"])
                        if i > 0 and precisions[i] == b
                    )
                    / float_epoch
                    for b in sorted(set(precisions[1:]))
                },
                gpu_speedup_estimate={
                    gpu: estimate_speedup(precisions, gpu)["speedup"]
                    for gpu in GPU_THROUGHPUT
                },
                cost_model_assumptions=estimate_speedup(precisions)[
                    "assumptions"
                ],
            )
            if name == "muppet" and args.model == "cnn":
                try:
                    entry["plot"] = plot_precision(
                        r["callback"], os.path.join(args.out, "muppet.png")
                    )
                except ImportError as e:
                    entry["plot"] = str(e)
        results[name] = entry
    return results


def _table(report):
    """The Markdown of one model's report (the CNN's or an applications
    model's): setup, the result table, precision per epoch."""
    cfg, res = report["config"], report["results"]
    f32 = res["float32"]["test_accuracy"]
    fixed = [n for n in ("muppet", "fixed_schedule") if n in res]
    if report.get("model", "cnn") == "cnn":
        setup = "CNN (2 conv + 2 dense)"
    else:
        setup = (
            f"`keras.applications` {APPLICATIONS[report['model']]} "
            "(weights=None, 32x32 zero-padded Fashion-MNIST, one channel, "
            f"BatchNorm momentum {BN_MOMENTUM}; no fixed-schedule run: the "
            "fixed-point copy takes minutes to trace on this CPU)"
        )
    lines = [
        f"Command: `{report['command']}`  ",
        f"TensorFlow {report['tensorflow']}, Keras {report['keras']}, "
        f"{report['cpu_count']} CPU cores (shared), {report['seconds']:.0f} s.",
        "",
        f"{setup}, Adam lr={cfg['lr']}, batch "
        f"{cfg['batch_size']}, {cfg['epochs']} epochs of "
        f"{cfg['samples_per_epoch']} training images (seeded permutations "
        f"of the 60,000; {cfg['epochs'] * cfg['samples_per_epoch']:,} "
        f"images seen), test on {cfg['test_images']} real test images. "
        f"Adaptive: schedule 8, 12, 14, 16, float32; r={cfg['resolution']}, "
        f"gamma={cfg['patience']}."
        + (
            f" Fixed: switches at epochs {list(cfg['fixed_epoch_schedule'])}."
            if "fixed_schedule" in res
            else ""
        ),
        "",
        "| run | test acc. | vs float32 (points) | float32-inference acc. "
        "| switch epochs | epoch time / float32 (CPU emulation) "
        "| est. GPU speed-up (RTX 2080 Ti / T4) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in res.items():
        gpu = r.get("gpu_speedup_estimate")
        f32_inference = r.get("test_accuracy_float32_inference", f32)
        lines.append(
            f"| {name} | {r['test_accuracy']:.4f} | "
            f"{100 * (r['test_accuracy'] - f32):+.2f} | "
            f"{f32_inference:.4f} | {r.get('switch_epochs', '-')} | "
            f"{r['epoch_time_ratio_to_float32']:.2f}x | "
            + (
                f"{gpu['rtx2080ti']:.2f}x / {gpu['t4']:.2f}x |"
                if gpu
                else "1.00x (baseline) |"
            )
        )
    for name in fixed:
        r = res[name]
        lines += [
            "",
            f"**{name}** precision per epoch: {r['precision_per_epoch']}  ",
            "CPU epoch time / float32 by precision: "
            + ", ".join(
                f"{b} bits {v:.2f}x"
                for b, v in r["time_ratio_per_precision"].items()
            ),
        ]
    return lines


def markdown(report):
    lines = ["# MuPPET on Fashion-MNIST", ""]
    if "results" in report:
        lines += _table(report)
    for model, sub in report.get("applications", {}).items():
        lines += ["", f"## {APPLICATIONS[model]}", ""] + _table(sub)
    assumptions = next(
        r["results"]["muppet"]["cost_model_assumptions"]
        for r in [report, *report.get("applications", {}).values()]
        if "results" in r
    )
    lines += [
        "",
        "The CPU time ratios are the cost of *emulating* fixed point in "
        "float32 kernels (quantize, round, clamp on every weight, "
        "activation and gradient): on this CPU MuPPET is slower than "
        "float32, and no CPU figure here is a speed-up. The GPU column is "
        "the cost model's estimate, not a measurement: "
        f"{assumptions}.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None):
    parser = bench_parser(__doc__)
    parser.add_argument(
        "--model",
        choices=("cnn", *APPLICATIONS),
        default="cnn",
        help="cnn (default) or a keras.applications model; each writes its "
        "own part of muppet.json and keeps the other's",
    )
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--samples-per-epoch", type=int)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--resolution", type=int)
    parser.add_argument("--patience", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs = args.epochs or 6
        args.samples_per_epoch = args.samples_per_epoch or 2048
        args.resolution = args.resolution or 2
        args.patience = min(args.patience, 1)
    elif args.model == "cnn":
        args.epochs = args.epochs or 36
        args.samples_per_epoch = args.samples_per_epoch or 6400
        args.resolution = args.resolution or 3
    else:
        # 320,000 images: enough for the policy to leave 8 bits (shorter
        # runs end at 8 or 12 bits and miss the 0.5-point goal; about 50
        # minutes on 2 cores)
        args.epochs = args.epochs or 50
        args.samples_per_epoch = args.samples_per_epoch or 6400
        args.resolution = args.resolution or 3
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    results = run(args)
    sub = {
        "model": args.model,
        "command": " ".join(
            ["python benchmarks/bench_muppet.py"]
            + (argv if argv is not None else sys.argv[1:])
        ),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "seconds": time.perf_counter() - start,
        "config": {
            "quick": args.quick,
            "epochs": args.epochs,
            "samples_per_epoch": args.samples_per_epoch,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "resolution": args.resolution,
            "patience": args.patience,
            "seed": args.seed,
            "test_images": 2000 if args.quick else 10000,
            "fixed_epoch_schedule": fixed_schedule(args.epochs, 5),
        },
        "results": results,
    }
    path = os.path.join(args.out, "muppet.json")
    report = {}
    if os.path.exists(path):
        with open(path) as f:
            report = json.load(f)
    if args.model == "cnn":
        report = {**sub, "applications": report.get("applications", {})}
    else:
        report.setdefault("applications", {})[args.model] = sub
    atomic_write_text(path, json.dumps(report, indent=2, default=float))
    atomic_write_text(os.path.join(args.out, "muppet.md"), markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()

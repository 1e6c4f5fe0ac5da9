"""`keras-mp demo`: the pipeline end to end on real data.

float training (under the policy this machine gains from) -> PTQ with each
calibrator -> QAT -> 2:4 sparse fine-tune + QAT -> export each to Q/DQ ONNX
-> TensorRT lint -> ONNX Runtime parity and CPU latency -> report folder;
then the same for a small keras-hub ViT (`demo_vit.py`).
"""

import os
import time

import keras
import numpy as np

from keras_mp import datasets
from keras_mp.cli.demo_vit import demo_vit
from keras_mp.cli.report import plot_results, write_report
from keras_mp.mixed_precision import (
    LossScaleMonitor,
    LossScaleOptimizer,
    apply_mixed_precision,
    enable_mixed_precision,
    mixed_precision_audit,
)
from keras_mp.onnx import check_tensorrt, export_onnx
from keras_mp.onnx.parity import ort_session, run_session
from keras_mp.precision import auto_quantize
from keras_mp.quantization import calibrate, quantize_model
from keras_mp.reference import (
    QAT_CALIBRATOR,
    compile_classifier,
    fine_tune,
    reference_cnn,
)
from keras_mp.sparsity import StructuredSparsity, permute_for_sparsity

CALIBRATORS = ("max", "percentile", "entropy", "mse", "auto")
# auto_quantize's budget (top-1 as a fraction) and the GPU it prices
AUTO_MAX_DROP, AUTO_GPU = 0.005, "H100"


BATCH = 128

TRAIN_LEARNING_RATE = 1e-3
# --quick: most of its time is tracing the 8 models (docs/getting-started.md).
QUICK_TRAIN_IMAGES = 6000
# The loss-scale probe: mixed_float16 steps on small batches (CPUs without
# float16 math run it far slower than float32; docs/getting-started.md).
QUICK_PROBE_STEPS = 10
FULL_PROBE_STEPS = 40
PROBE_BATCH = 32


def load_demo_data(quick):
    """Fashion-MNIST when installed, else scikit-learn digits (said plainly)."""
    name, (x, y), (xt, yt) = datasets.load_images()
    if quick:
        n = QUICK_TRAIN_IMAGES
        x, y, xt, yt = x[:n], y[:n], xt[:1000], yt[:1000]
    return name, (x, y), (xt, yt)


def _prepare_output(output, overwrite):
    if os.path.exists(os.path.join(output, "report.md")) and not overwrite:
        raise FileExistsError(
            f"{output} already holds a report. Pass --overwrite to replace "
            "it, or choose another --output folder."
        )
    os.makedirs(output, exist_ok=True)


def _latency_ms(path, x, repeats):
    session = ort_session(path)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run_session(session, [x])
        times.append(time.perf_counter() - start)
    return 1000 * float(np.median(times))


def _eval_batch(n, most=512):
    """The largest batch <= `most` that divides `n` (one traced shape), or
    `most` when that batch would be small (a second trace is cheaper)."""
    best = next(b for b in range(min(most, n), 0, -1) if n % b == 0)
    return best if best >= min(64, n) else most


def _loss_scale_probe(x, y, width, steps):
    """`steps` mixed_float16 steps with dynamic loss scaling: the scale
    history and a summary."""
    print(f"Loss scaling: {steps} mixed_float16 steps on a copy")
    with enable_mixed_precision("mixed_float16"):
        keras.utils.set_random_seed(1)
        model = apply_mixed_precision(reference_cnn(x.shape[1:], width=width))
        optimizer = LossScaleOptimizer(keras.optimizers.Adam(1e-3))
        compile_classifier(model, optimizer=optimizer)
        monitor = LossScaleMonitor()
        n = min(len(x), steps * PROBE_BATCH)
        model.fit(
            datasets.shuffled_batches(x[:n], y[:n], PROBE_BATCH, seed=1),
            epochs=1,
            callbacks=[monitor],
        )
    return monitor.scale_history, {
        "policy": "mixed_float16",
        "steps": max(1, n // PROBE_BATCH),
        "batch_size": PROBE_BATCH,
        "initial_scale": float(optimizer.initial_scale),
        "growth_steps": int(optimizer.dynamic_growth_steps),
        "scale_history": [float(s) for _, s in monitor.scale_history],
        "final_scale": float(optimizer.loss_scale),
        "skipped_steps": int(optimizer.skipped_steps),
    }


def run_demo(output="demo-report", quick=False, overwrite=False):
    """Runs the demo pipeline and writes the report folder.

    Args:
        output: str. Report folder. Defaults to `"demo-report"`.
        quick: bool. About two minutes on 2 CPU cores, on 6,000 images. Defaults
            to False.
        overwrite: bool. Replace an existing report. Defaults to False.

    Returns:
        The results dict (also in `results.json`).
    """
    _prepare_output(output, overwrite)
    name, (x, y), (xt, yt) = load_demo_data(quick)
    epochs, qat_epochs = (2, 1) if quick else (3, 1)
    width = 16
    results = {"data": name, "train_images": len(x), "test_images": len(xt)}

    # 1. float training under the policy this machine gains from.
    with enable_mixed_precision("auto") as previous:
        policy = keras.mixed_precision.global_policy().name
    print(f"Training policy: {policy}. {previous.reason}")
    with enable_mixed_precision("mixed_float16"):
        audit = mixed_precision_audit(
            apply_mixed_precision(reference_cnn(x.shape[1:], width=width)),
            batch_size=128,
            verbose=False,
        )
    keras.utils.set_random_seed(0)
    model = apply_mixed_precision(
        reference_cnn(x.shape[1:], width=width), policy
    )
    optimizer = keras.optimizers.Adam(TRAIN_LEARNING_RATE)
    if policy == "mixed_float16":
        optimizer = LossScaleOptimizer(optimizer)
    compile_classifier(model, optimizer=optimizer)
    monitor = LossScaleMonitor()
    start = time.perf_counter()
    model.fit(
        datasets.shuffled_batches(x, y, BATCH),
        epochs=epochs,
        callbacks=[monitor],
    )
    results["train_seconds"] = round(time.perf_counter() - start, 1)
    results["policy"] = {"name": policy, "reason": previous.reason}
    scale_history = monitor.scale_history
    if policy != "mixed_float16":
        # Show dynamic loss scaling anyway, on a short mixed_float16 run of
        # a copy (slower on a CPU, which has no float16 math units).
        scale_history, results["loss_scale_probe"] = _loss_scale_probe(
            x, y, width, steps=QUICK_PROBE_STEPS if quick else FULL_PROBE_STEPS
        )

    calib = x[: 512 if quick else 2048]
    probe = xt[:1000]
    methods = {}
    models = {"float32": model}
    clips = {}  # method -> the tensor it clips most, and how much
    for method in CALIBRATORS:
        print(f"PTQ, {method} calibration")
        q = quantize_model(model)
        report = calibrate(q, calib, method=method, verbose=0)
        models[f"ptq_{method}"] = q
        name, fraction = max(
            report.saturated.items(), key=lambda kv: kv[1], default=("", 0.0)
        )
        clips[method] = {"quantizer": name, "percent": round(100 * fraction, 2)}
    print(
        f"auto_quantize: INT8, FP8 or float per layer, least predicted "
        f"{AUTO_GPU} latency within {100 * AUTO_MAX_DROP:g} point"
    )
    held = x[-(1000 if quick else 5000) :]  # the metric's images
    auto, choice = auto_quantize(
        model,
        calib,
        y[: len(calib)],
        max_drop=AUTO_MAX_DROP,
        gpu=AUTO_GPU,
        eval_data=held,
        eval_labels=y[-len(held) :],
        verbose=0,
    )
    print(choice)
    models["auto_quantize"] = auto
    results["auto_quantize"] = {
        "gpu": AUTO_GPU,
        "max_drop": AUTO_MAX_DROP,
        "eval_images": len(held),
        "choices": [(c.name, c.precision) for c in choice.rows],
        "drop_on_eval_images": choice.drop,
        "quantized_flops": choice.quantized_flops,
        "predicted_speedup_over_fp16": choice.speedup_over_fp16,
        "seconds": round(choice.seconds, 1),
    }
    # QAT starts from percentile ranges whatever PTQ preferred: tighter
    # ranges give the fine-tune finer steps (docs/quantization.md).
    print("QAT from percentile calibration")
    qat = quantize_model(model)
    calibrate(qat, calib, method=QAT_CALIBRATOR, verbose=0)
    models["qat"] = fine_tune(qat, x, y, qat_epochs)
    control = keras.models.clone_model(model)
    control.set_weights(model.get_weights())
    models["float32_control"] = fine_tune(control, x, y, qat_epochs)
    print("2:4 sparse retraining, then QAT")
    sparse = keras.models.clone_model(model)
    sparse.set_weights(model.get_weights())
    # NVIDIA ASP's recipe: permute channels so 2:4 keeps more |w|, leave
    # dense the layers sparse Tensor Cores do not take (the 10-way logits),
    # retrain at the training rate: the fine-tune's 1e-4 leaves the pruned
    # model behind the control.
    permute_for_sparsity(sparse)
    pruning = StructuredSparsity(skip_unaligned=True)
    fine_tune(
        sparse,
        x,
        y,
        qat_epochs,
        learning_rate=TRAIN_LEARNING_RATE,
        callbacks=[pruning],
    )
    sparsity = pruning.report
    sparse_qat = quantize_model(sparse)
    calibrate(sparse_qat, calib, method=QAT_CALIBRATOR, verbose=0)
    # The masks are recomputed on the QAT copy from the kernel's zeros, so
    # QAT keeps the 2:4 pattern (symmetric quantization maps 0 to 0).
    models["sparse_2_4_qat"] = fine_tune(
        sparse_qat,
        x,
        y,
        qat_epochs,
        callbacks=[StructuredSparsity(skip_unaligned=True)],
    )

    progbar = keras.utils.Progbar(len(models), unit_name="model")
    for i, (label, m) in enumerate(models.items()):
        compile_classifier(m)
        _, acc = m.evaluate(xt, yt, batch_size=_eval_batch(len(xt)), verbose=0)
        path = os.path.join(output, f"{label}.onnx")
        parity = export_onnx(m, path, verify_data=probe, overwrite=True)
        lint = check_tensorrt(path)
        methods[label] = {
            "test_top1": round(100 * float(acc), 2),
            "onnx": os.path.basename(path),
            "tensorrt_lint": "clean" if lint.ok else "violations",
            "qdq_nodes": lint.num_qdq,
            "sparse_2_4_weights": len(lint.sparse_weights),
            "parity_top1_agreement": round(100 * parity.top1_agreement, 2),
            "parity_rel_l2": float(f"{parity.rel_l2:.3g}"),
            "ort_optimized_top1_agreement": round(
                100 * parity.optimized_top1_agreement, 2
            ),
            "latency_ms_batch1": round(
                _latency_ms(path, probe[:1], 20 if quick else 100), 3
            ),
            "latency_ms_batch64": round(
                _latency_ms(path, probe[:64], 5 if quick else 20), 2
            ),
        }
        progbar.update(i + 1)
    results["methods"] = methods
    results["best_calibrator"] = max(
        CALIBRATORS, key=lambda m: methods[f"ptq_{m}"]["test_top1"]
    )
    results["calibration_clips"] = clips
    results["sparsity"] = [
        {
            "layer": r.name,
            "eligible": r.eligible,
            "fraction_zero": r.fraction_zero,
        }
        for r in sparsity.rows
    ]
    results["vit"] = demo_vit(x, y, xt, yt, output, quick)
    plots = plot_results(results, sparsity, scale_history, output)
    results["plots"] = plots
    write_report(
        output, results, audit, epochs, qat_epochs, TRAIN_LEARNING_RATE
    )
    return results


def demo_command_parser(subparsers):
    parser = subparsers.add_parser(
        "demo", help="the end-to-end pipeline on Fashion-MNIST"
    )
    parser.add_argument("--output", default="demo-report", help="report folder")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="about two minutes on 2 CPU cores: 6,000 images",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing report in --output",
    )
    parser.set_defaults(func=demo_command)


def demo_command(args):
    run_demo(output=args.output, quick=args.quick, overwrite=args.overwrite)
    return 0

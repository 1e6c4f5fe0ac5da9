"""`keras-mp demo`: the pipeline end to end on real data."""

import json
import os
import shutil
import time

import keras

from keras_mp import datasets
from keras_mp.io import atomic_write_text
from keras_mp.loss_scale import LossScaleOptimizer
from keras_mp.policy import (
    apply_mixed_precision,
    enable_mixed_precision,
    mixed_precision_audit,
)
from keras_mp.reference import compile_classifier, reference_cnn


def load_demo_data(quick):
    """Fashion-MNIST when installed, else scikit-learn digits (said plainly)."""
    if datasets.fashion_mnist_available():
        (x, y), (xt, yt) = datasets.load_fashion_mnist()
        name = "Fashion-MNIST (Debian dataset-fashion-mnist)"
    else:
        print(
            "Fashion-MNIST is not installed (`apt-get install "
            "dataset-fashion-mnist`); using scikit-learn's 8x8 digits."
        )
        (x, y), (xt, yt) = datasets.load_digits()
        name = "scikit-learn digits (Fashion-MNIST not installed)"
    if quick:
        x, y, xt, yt = x[:6000], y[:6000], xt[:2000], yt[:2000]
    return name, (x, y), (xt, yt)


def _prepare_output(output, overwrite):
    if os.path.exists(os.path.join(output, "report.md")) and not overwrite:
        raise FileExistsError(
            f"{output} already holds a report. Pass --overwrite to replace "
            "it, or choose another --output folder."
        )
    if overwrite and os.path.isdir(output):
        shutil.rmtree(output)
    os.makedirs(output, exist_ok=True)


def run_demo(output="demo-report", quick=False, overwrite=False, epochs=None):
    """Runs the demo pipeline and writes `report.md` and `results.json`.

    Args:
        output: str. Report folder. Defaults to `"demo-report"`.
        quick: bool. A one-minute run on a subset. Defaults to False.
        overwrite: bool. Replace an existing report. Defaults to False.
        epochs: int. Float training epochs; defaults to 1 (quick) or 4.

    Returns:
        The results as a dict (also in `results.json`).
    """
    _prepare_output(output, overwrite)
    name, (x, y), (xt, yt) = load_demo_data(quick)
    epochs = epochs or (1 if quick else 4)
    results = {"data": name, "train_images": len(x), "test_images": len(xt)}

    # Train under the policy this machine gains from ("auto": float32 on a
    # CPU without native bfloat16); audit the mixed_float16 build a GPU
    # would train.
    with enable_mixed_precision("auto") as previous:
        policy_name = keras.mixed_precision.global_policy().name
        print(f"Training policy: {policy_name}. {previous.reason}")
    with enable_mixed_precision("mixed_float16"):
        audit = mixed_precision_audit(
            apply_mixed_precision(reference_cnn(x.shape[1:])), batch_size=128
        )
    model = apply_mixed_precision(reference_cnn(x.shape[1:]), policy_name)
    optimizer = keras.optimizers.Adam(1e-3)
    if policy_name == "mixed_float16":
        optimizer = LossScaleOptimizer(optimizer)
    compile_classifier(model, optimizer=optimizer)
    start = time.perf_counter()
    model.fit(x, y, batch_size=128, epochs=epochs, validation_split=0.1)
    results["train_seconds"] = round(time.perf_counter() - start, 1)
    _, acc = model.evaluate(xt, yt, batch_size=512, verbose=0)
    results["mixed_precision"] = {
        "policy": policy_name,
        "policy_reason": previous.reason,
        "test_top1": round(float(acc) * 100, 2),
        "audit": audit.summary,
    }
    print(f"\n{policy_name} test top-1: {acc * 100:.2f}%")
    lines = [
        "# keras_mp demo report",
        "",
        f"Data: {name}, {len(x)} training and {len(xt)} test images.",
        "",
        f"## Training policy: {policy_name}",
        "",
        previous.reason,
        "",
        f"Test top-1 after {epochs} epoch(s): {acc * 100:.2f}%",
        "",
        "Tensor Core audit of the mixed_float16 build:",
        "",
        "```",
        audit.to_table(),
        "```",
    ]
    atomic_write_text(
        os.path.join(output, "results.json"), json.dumps(results, indent=2)
    )
    atomic_write_text(
        os.path.join(output, "report.md"), "\n".join(lines) + "\n"
    )
    print(f"Report written to {output}/report.md")
    return results

"""Plumbing shared by the peer helpers. NumPy only: it is imported in the
main venv and in the tfmot venv (tf_keras), so it imports neither keras_mp
nor Keras."""

import json
import os
import time

import numpy as np

BATCH = 128


def norm(v):
    """keras_mp.load_fashion_mnist's normalization: float32 / 255, NHWC."""
    return (v.astype("float32") / 255.0)[..., None]


def load_data(workdir):
    """The split written by train_float.py, normalized."""
    d = np.load(os.path.join(workdir, "data.npz"))
    return {
        "x_train": norm(d["x_train"]),
        "y_train": d["y_train"],
        "x_val": norm(d["x_val"]),
        "y_val": d["y_val"],
        "x_test": norm(d["x_test"]),
        "y_test": d["y_test"],
        "x_calib": norm(d["x_calib"]),
        "finetune_order": d["finetune_order"],
    }


def finetune_arrays(data):
    """The fixed fine-tune order (same for every QAT run and control)."""
    order = data["finetune_order"]
    return data["x_train"][order], data["y_train"][order]


def write_json(workdir, name, obj):
    path = os.path.join(workdir, f"{name}.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)
    print(json.dumps(obj, indent=2))


def interleaved_step_times(steps, rounds, repeats, warmup=2):
    """Median seconds per call of each `steps[name]()`, measured side by side.

    Rounds alternate the order (A B, B A, ...) so drift on a shared machine
    hits every candidate alike; each round takes the median of `repeats`
    calls, and the result is the median over rounds. Also returns the
    per-round ratios of the second entry to the first.
    """
    names = list(steps)
    for name in names:
        for _ in range(warmup):
            steps[name]()
    times = {n: [] for n in names}
    for r in range(rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            t = []
            for _ in range(repeats):
                start = time.perf_counter()
                steps[n]()
                t.append(time.perf_counter() - start)
            times[n].append(float(np.median(t)))
    median = {n: float(np.median(v)) for n, v in times.items()}
    a, b = names[0], names[1]
    per_round = [y / x for x, y in zip(times[a], times[b])]
    return median, per_round


def cosine_lr_note(lr, steps):
    return f"Adam(CosineDecay({lr:g}, decay_steps={steps}))"

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


def step_time_report(float_step, qat_step, rounds, repeats, warmup=3):
    """QAT train step vs float32 train step, measured side by side.

    Each round times `repeats` calls of one model, then of the other (the
    order alternates every round), so drift on a shared machine hits both
    alike. Reports the median wall time per call over all calls, the ratio
    of the medians, the quartiles of the per-round ratios (spread), and the
    same ratio in process CPU time, which other processes on the machine
    disturb less than wall time.
    """
    steps = {"float32": float_step, "qat": qat_step}
    for step in steps.values():
        for _ in range(warmup):
            step()
    wall = {k: [] for k in steps}
    cpu = {k: [] for k in steps}
    per_round = []
    for r in range(rounds):
        order = list(steps) if r % 2 == 0 else list(steps)[::-1]
        block = {}
        for k in order:
            t = []
            for _ in range(repeats):
                w0, c0 = time.perf_counter(), time.process_time()
                steps[k]()
                t.append(time.perf_counter() - w0)
                cpu[k].append(time.process_time() - c0)
            wall[k] += t
            block[k] = float(np.median(t))
        per_round.append(block["qat"] / block["float32"])
    med = {k: float(np.median(v)) for k, v in wall.items()}
    med_cpu = {k: float(np.median(v)) for k, v in cpu.items()}
    q1, q2, q3 = np.percentile(per_round, [25, 50, 75])
    return {
        "float32_seconds": round(med["float32"], 4),
        "qat_seconds": round(med["qat"], 4),
        "ratio": round(med["qat"] / med["float32"], 3),
        "per_round_ratio_quartiles": [round(float(q), 3) for q in (q1, q2, q3)],
        "cpu_ratio": round(med_cpu["qat"] / med_cpu["float32"], 3),
        "method": f"train_on_batch, batch {BATCH}, {rounds} interleaved "
        f"rounds x {repeats} calls per model (order alternating), median "
        "wall time per call; cpu_ratio: the same with process CPU time",
    }


def cosine_lr_note(lr, steps):
    return f"Adam(CosineDecay({lr:g}, decay_steps={steps}))"

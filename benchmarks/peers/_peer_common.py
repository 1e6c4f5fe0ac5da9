"""Plumbing shared by the peer helpers. NumPy only: it is imported in the
main venv and in the tfmot venv (tf_keras), so it imports neither keras_mp
nor Keras."""

import argparse
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


def finetune_arrays(data, order=0):
    """The training images in fine-tune order `order`, for every tool alike.

    Order 0 is the shared fixed order written by train_float.py; order k > 0
    is that order permuted by a generator seeded k, so for each k every QAT
    run and control, whatever its framework, sees identical batches.
    """
    idx = data["finetune_order"]
    if order:
        idx = idx[np.random.default_rng(order).permutation(len(idx))]
    return data["x_train"][idx], data["y_train"][idx]


def positive_int(text):
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def finetune_orders(data, orders, seed, set_seed, builders, top1):
    """Fine-tunes fresh models on each of `orders` fine-tune orders.

    For order k, each builder (name -> function returning a fresh compiled
    model; "control" and "qat") runs with the framework seed `seed + 1 + k`,
    then its model is fine-tuned one epoch on order k, unshuffled, and its
    test top-1 taken with `top1(model, x, y)`. The loop is shared so both
    QAT tools fine-tune the same way.

    Returns (runs, first): runs is one dict per order, {"order": k,
    "<name>_keras_test_top1": ...}; first maps each name to order 0's
    (model, fine-tune seconds), the models exported and step-timed.
    """
    runs, first = [], {}
    for k in range(orders):
        x, y = finetune_arrays(data, k)
        run = {"order": k}
        for name, build in builders.items():
            set_seed(seed + 1 + k)
            model = build()
            start = time.perf_counter()
            model.fit(
                x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=2
            )
            seconds = round(time.perf_counter() - start, 1)
            run[f"{name}_keras_test_top1"] = top1(
                model, data["x_test"], data["y_test"]
            )
            if k == 0:
                first[name] = (model, seconds)
        print(f"fine-tune order {k}: {run}", flush=True)
        runs.append(run)
    return runs, first


def mean_and_sd(values):
    """Mean and sample sd (ddof=1; 0 for a single value), to 2 decimals."""
    v = np.asarray(values, dtype=float)
    sd = float(v.std(ddof=1)) if len(v) > 1 else 0.0
    return round(float(v.mean()), 2), round(sd, 2)


def order_summary(runs, name):
    """`name`'s Keras test top-1: order 0's (the exported model's), and the
    mean and sd over the fine-tune orders."""
    values = [r[f"{name}_keras_test_top1"] for r in runs]
    mean, sd = mean_and_sd(values)
    return {
        "keras_test_top1": values[0],
        "keras_test_top1_mean": mean,
        "keras_test_top1_sd": sd,
    }


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

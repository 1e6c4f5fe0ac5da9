"""2:4 structured sparsity on Fashion-MNIST: accuracy and step-time cost.

The reference CNN (conv/BN/ReLU, channels multiples of 8) is trained dense
for E epochs. Then, side by side from the same weights:

- one-shot 2:4 magnitude pruning, evaluated right away (no retraining);
- the pruned model retrained E more epochs with `StructuredSparsity`;
- a dense control trained the same E extra epochs (goal: the sparse model
  within 0.5 points of it), for `--seeds` batch orders (mean judged);
- the retrained 2:4 model quantized, calibrated and fine-tuned one epoch
  with QAT (masks kept), against the dense control fine-tuned the same
  extra epoch in float (goal: within 0.8 points);
- the step time of the sparse fit vs the dense fit, measured in interleaved
  rounds in this one run (goal: <= 10 % overhead);
- the share of weight magnitude 2:4 keeps with and without a channel
  permutation (`permute_for_sparsity` on a copy of the dense model; its
  outputs must not change), and that copy's top-1 right after one-shot
  pruning.

    python benchmarks/bench_sparsity.py [--quick]
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _common import markdown_table, write_results  # noqa: E402

import keras_mp  # noqa: E402
from keras_mp.datasets import load_fashion_mnist  # noqa: E402
from keras_mp.permutation import permute_for_sparsity  # noqa: E402
from keras_mp.reference import compile_classifier, reference_cnn  # noqa: E402
from keras_mp.sparsity import strip_sparsity  # noqa: E402
from keras_mp.sparsity_callback import StructuredSparsity  # noqa: E402
from keras_mp.sparsity_report import sparsity_report  # noqa: E402

BATCH = 128


def top1(model, xt, yt):
    _, acc = model.evaluate(xt, yt, batch_size=1000, verbose=0)
    return round(100 * float(acc), 2)


def copy_of(model, width):
    clone = reference_cnn(width=width)
    clone.set_weights(model.get_weights())
    return compile_classifier(clone)


def prune_now(model):
    """One-shot 2:4 prune outside `fit`, to score before any retraining:
    these are the two hooks `fit` calls before its first step."""
    sparsity = StructuredSparsity()
    sparsity.set_model(model)
    sparsity.on_train_batch_begin(0)
    return sparsity


def total_kept(model, kept):
    """Share of sum |w| that 2:4 keeps over layers: `kept` is name -> share."""
    weights = {
        name: float(np.abs(model.get_layer(name).kernel.numpy()).sum())
        for name in kept
    }
    total = sum(kept[name] * weights[name] for name in kept)
    return round(total / sum(weights.values()), 4)


def permutation_results(dense, width, xt, yt):
    """Kept |w| with and without permutation, and one-shot top-1 with it."""
    report = sparsity_report(dense, permutation=True)
    search = [r for r in report.rows if r.eligible]
    permuted = copy_of(dense, width)
    start = time.perf_counter()
    rows = {r.name: r for r in permute_for_sparsity(permuted)}
    seconds = time.perf_counter() - start
    diff = np.abs(
        permuted.predict(xt[:512], verbose=0)
        - dense.predict(xt[:512], verbose=0)
    ).max()
    prune_now(permuted)
    # What the one-shot prune of the permuted copy kept, layer by layer.
    pruned = [r for r in sparsity_report(permuted).rows if r.eligible]
    return {
        "one_shot_permuted_top1": top1(permuted, xt, yt),
        "search_seconds": round(seconds, 2),
        "function_max_abs_diff": float(diff),
        "kept_magnitude_total": {
            "original_order": total_kept(
                dense, {r.name: r.kept_magnitude for r in search}
            ),
            "permuted_where_the_model_allows": total_kept(
                dense, {r.name: r.kept_magnitude for r in pruned}
            ),
            "permuted_every_layer_if_it_could": total_kept(
                dense, {r.name: r.kept_magnitude_permuted for r in search}
            ),
        },
        "layers": {
            r.name: {
                "kept_magnitude_permuted_search": r.kept_magnitude_permuted,
                "permuted_in_model": rows[r.name].permuted,
                "why_not": rows[r.name].reason,
            }
            for r in search
        },
    }


def timed_fit(model, x, y, callbacks):
    start = time.perf_counter()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    return (time.perf_counter() - start) / (len(x) // BATCH)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smoke run")
    parser.add_argument("--train-images", type=int, default=12000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--timing-rounds", type=int, default=10)
    parser.add_argument("--timing-batches", type=int, default=10)
    parser.add_argument(
        "--seeds", type=int, default=3, help="retraining seeds (batch orders)"
    )
    args = parser.parse_args()
    if args.quick:
        args.train_images, args.epochs = 2048, 1
        args.timing_rounds, args.timing_batches, args.seeds = 2, 8, 1
    (x, y), (xt, yt) = load_fashion_mnist()
    x, y = x[: args.train_images], y[: args.train_images]
    fit = dict(batch_size=BATCH, epochs=args.epochs, verbose=2)

    keras.utils.set_random_seed(0)
    dense = compile_classifier(reference_cnn(width=args.width))
    dense.fit(x, y, **fit)
    results = {"dense_top1": top1(dense, xt, yt)}

    one_shot = copy_of(dense, args.width)
    prune_now(one_shot)
    report = sparsity_report(one_shot)
    results["one_shot_top1"] = top1(one_shot, xt, yt)
    permutation = permutation_results(dense, args.width, xt, yt)
    results["one_shot_permuted_top1"] = permutation.pop(
        "one_shot_permuted_top1"
    )
    results["permutation"] = permutation

    # Retraining, once per seed (batch order and dropout-free init of the
    # fit): dense control and 2:4 from the same dense weights; then sparse +
    # QAT INT8 (1 epoch, cosine from 1e-4, masks kept) against the control
    # fine-tuned the same extra epoch in float.
    runs = []
    for seed in range(1, args.seeds + 1):
        control = copy_of(dense, args.width)
        sparse = copy_of(dense, args.width)
        sparsity = prune_now(sparse)
        keras.utils.set_random_seed(seed)
        control.fit(x, y, **fit)
        keras.utils.set_random_seed(seed)
        sparse.fit(x, y, callbacks=[sparsity], **fit)
        run = {
            "seed": seed,
            "dense_control_top1": top1(control, xt, yt),
            "sparse_retrained_top1": top1(sparse, xt, yt),
        }
        qat = keras_mp.quantize_model(sparse)
        keras_mp.calibrate(qat, x[:2048], method="max", verbose=0)
        control_ft = copy_of(control, args.width)
        for model, callbacks in (
            (control_ft, []),
            (qat, [StructuredSparsity()]),
        ):
            keras.utils.set_random_seed(seed)
            steps = int(np.ceil(len(x) / BATCH))
            compile_classifier(
                model,
                optimizer=keras.optimizers.Adam(
                    keras.optimizers.schedules.CosineDecay(1e-4, steps)
                ),
            )
            model.fit(
                x,
                y,
                batch_size=BATCH,
                epochs=1,
                verbose=2,
                callbacks=callbacks,
            )
        run["dense_control_plus_1_top1"] = top1(control_ft, xt, yt)
        run["sparse_qat_int8_top1"] = top1(qat, xt, yt)
        run["sparse_qat_still_2_4"] = all(
            keras_mp.is_2_4_sparse(
                w.layer.kernel.numpy(), 0 if w.layer.kernel.ndim == 2 else -2
            )
            for w in qat.layers
            if isinstance(w, keras_mp.QuantizeWrapper)
            and w.layer.name in {r.name for r in report.rows if r.eligible}
        )
        run["retrained_gap_points"] = round(
            run["dense_control_top1"] - run["sparse_retrained_top1"], 2
        )
        run["sparse_qat_gap_points"] = round(
            run["dense_control_plus_1_top1"] - run["sparse_qat_int8_top1"], 2
        )
        runs.append(run)
        print(run)
    results["runs"] = runs
    for key in (
        "dense_control_top1",
        "sparse_retrained_top1",
        "dense_control_plus_1_top1",
        "sparse_qat_int8_top1",
    ):
        results[key] = round(float(np.mean([r[key] for r in runs])), 2)
    gaps = np.array([r["retrained_gap_points"] for r in runs])
    qat_gaps = np.array([r["sparse_qat_gap_points"] for r in runs])
    gap, qat_gap = float(gaps.mean()), float(qat_gaps.mean())
    sd = lambda v: float(np.std(v, ddof=1)) if len(v) > 1 else 0.0  # noqa: E731
    results["retrained_gap_points"] = round(gap, 2)
    results["retrained_gap_sd_points"] = round(sd(gaps), 2)
    results["accuracy_goal_met"] = bool(gap <= 0.5)
    results["sparse_qat_gap_points"] = round(qat_gap, 2)
    results["sparse_qat_gap_sd_points"] = round(sd(qat_gaps), 2)
    results["sparse_qat_goal_met"] = bool(qat_gap <= 0.8)
    results["sparse_qat_still_2_4"] = all(
        r["sparse_qat_still_2_4"] for r in runs
    )
    stripped = strip_sparsity(sparse)
    report_after = sparsity_report(sparse)
    results["all_pruned_layers_2_4"] = all(
        r.pattern_valid for r in report_after.rows if r.eligible
    )
    results["strip_max_abs_diff"] = float(
        np.abs(
            stripped.predict(xt[:512], verbose=0)
            - sparse.predict(xt[:512], verbose=0)
        ).max()
    )

    # Step time: the same short fit on each model, in A-B-B-A rounds so
    # machine noise (other processes share the CPU) hits both alike; the
    # overhead is the median of the per-round paired ratios.
    xs, ys = x[: args.timing_batches * BATCH], y[: args.timing_batches * BATCH]
    timed_fit(control, xs, ys, [])  # warm-up
    timed_fit(sparse, xs, ys, [sparsity])
    times = {"dense": [], "sparse": []}
    for i in range(args.timing_rounds):
        order = ("dense", "sparse") if i % 2 == 0 else ("sparse", "dense")
        for name in order:
            if name == "dense":
                times[name].append(timed_fit(control, xs, ys, []))
            else:
                times[name].append(timed_fit(sparse, xs, ys, [sparsity]))
    ratios = np.array(times["sparse"]) / np.array(times["dense"])
    overhead = 100 * (float(np.median(ratios)) - 1)
    results["step_ms_median"] = {
        k: round(1000 * float(np.median(v)), 2) for k, v in times.items()
    }
    results["step_ms_min"] = {
        k: round(1000 * float(np.min(v)), 2) for k, v in times.items()
    }
    results["step_overhead_percent"] = round(overhead, 1)
    results["step_overhead_percent_of_minimums"] = round(
        100 * (min(times["sparse"]) / min(times["dense"]) - 1), 1
    )
    results["overhead_goal_met"] = bool(overhead <= 10)
    results["layers"] = [
        {
            "name": r.name,
            "eligible": r.eligible,
            "reason": r.reason,
            "kept_magnitude": r.kept_magnitude,
            **permutation["layers"].get(r.name, {}),
            "fraction_zero_after": a.fraction_zero,
            "pattern_valid_after": a.pattern_valid,
        }
        for r, a in zip(report.rows, report_after.rows)
    ]
    results["config"] = vars(args)

    rows = [
        ("dense, after E epochs", results["dense_top1"]),
        ("one-shot 2:4, no retraining", results["one_shot_top1"]),
        (
            "one-shot 2:4, channels permuted first, no retraining",
            results["one_shot_permuted_top1"],
        ),
        (
            f"dense control, +E epochs (mean of {args.seeds} seeds)",
            results["dense_control_top1"],
        ),
        (
            f"2:4 retrained, +E epochs (mean of {args.seeds} seeds)",
            results["sparse_retrained_top1"],
        ),
        (
            "dense control, +E epochs +1 float fine-tune epoch",
            results["dense_control_plus_1_top1"],
        ),
        (
            "2:4 retrained, then QAT INT8 1 epoch (masks kept)",
            results["sparse_qat_int8_top1"],
        ),
    ]

    def fmt(value):
        return "-" if value is None else f"{value:.3f}"

    def permuted_cell(r):
        if "permuted_in_model" not in r:
            return "-"
        return "yes" if r["permuted_in_model"] else f"no: {r['why_not']}"

    layer_rows = [
        (
            r["name"],
            "yes" if r["eligible"] else f"no: {r['reason']}",
            fmt(r["kept_magnitude"]),
            fmt(r.get("kept_magnitude_permuted_search")),
            permuted_cell(r),
            "-"
            if r["pattern_valid_after"] is None
            else r["pattern_valid_after"],
        )
        for r in results["layers"]
    ]
    totals = permutation["kept_magnitude_total"]
    md = (
        f"Reference CNN (width {args.width}), {len(x)} Fashion-MNIST "
        f"training images, E={args.epochs} epochs, batch {BATCH}, 10,000 "
        "test images.\n\n"
        + markdown_table(("model", "test top-1 %"), rows)
        + f"\n\nRetrained 2:4 vs dense control: {-gap:+.2f} points, mean of "
        f"{args.seeds} seeds (sd {results['retrained_gap_sd_points']:.2f}; "
        f"goal: within 0.5: {'PASS' if gap <= 0.5 else 'FAIL'}). 2:4 + QAT "
        f"INT8 vs the dense control with the same extra epoch: "
        f"{-qat_gap:+.2f} points (sd {results['sparse_qat_gap_sd_points']:.2f}"
        f"; goal: within 0.8: {'PASS' if qat_gap <= 0.8 else 'FAIL'}); the "
        "QAT models are still 2:4 sparse: "
        f"{results['sparse_qat_still_2_4']}.\n\n"
        + markdown_table(
            (
                "seed",
                "dense control",
                "2:4 retrained",
                "control +1 ep",
                "2:4 + QAT INT8",
            ),
            [
                (
                    r["seed"],
                    r["dense_control_top1"],
                    r["sparse_retrained_top1"],
                    r["dense_control_plus_1_top1"],
                    r["sparse_qat_int8_top1"],
                )
                for r in runs
            ],
        )
        + "\n\n"
        f"Step time inside `fit`, {args.timing_rounds} A-B-B-A rounds of "
        f"{args.timing_batches} batches: median dense "
        f"{results['step_ms_median']['dense']} ms, 2:4 with the callback "
        f"{results['step_ms_median']['sparse']} ms; median paired overhead "
        f"{overhead:+.1f} % (of the fastest rounds: "
        f"{results['step_overhead_percent_of_minimums']:+.1f} %; goal: "
        "<= 10 %).\n\n"
        + "Share of the pruned layers' weight magnitude that 2:4 keeps: "
        f"{totals['original_order']:.4f} in the original channel order, "
        f"{totals['permuted_where_the_model_allows']:.4f} after "
        "`permute_for_sparsity` (which permutes only layers fed by a simple "
        "Dense/Conv chain), "
        f"{totals['permuted_every_layer_if_it_could']:.4f} if every layer "
        "could take the permutation found. Search time "
        f"{permutation['search_seconds']} s; outputs of the permuted model "
        f"differ by at most {permutation['function_max_abs_diff']:.1e}.\n\n"
        + markdown_table(
            (
                "layer",
                "pruned",
                "kept |w| at pruning",
                "kept |w|, channels permuted",
                "permuted in the model",
                "2:4 after",
            ),
            layer_rows,
        )
    )
    write_results("sparsity", results, md)


if __name__ == "__main__":
    main()

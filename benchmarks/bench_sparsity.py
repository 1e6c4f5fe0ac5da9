"""2:4 structured sparsity on Fashion-MNIST: accuracy and step-time cost.

The reference CNN (conv/BN/ReLU, channels multiples of 8; its default
width 32) is trained dense for E epochs on the 60,000 training images,
Adam with the learning rate cosine-decayed to 0 (NVIDIA ASP's recipe
retrains with the schedule of the original training). Then, side by side
from the same weights:

- one-shot 2:4 magnitude pruning, evaluated right away (no retraining);
- the pruned model retrained E more epochs with `StructuredSparsity`, the
  same cosine schedule restarted. Pruning follows NVIDIA ASP: layers whose
  shapes sparse Tensor Cores do not take (output channels not a multiple
  of 8 or input channels not of 16: here the 10-way logits) stay dense
  (`skip_unaligned=True`), and `permute_for_sparsity` reorders channels
  before the prune. `--every-layer` prunes every layer with input
  channels a multiple of 4, in the original channel order (the previous
  runs of this benchmark: -0.70 points against the control);
- a dense control trained the same E extra epochs with the same schedule
  (goal: the sparse model within 0.5 points of it), for `--seeds` batch
  orders (mean judged); both end at a low learning rate, so the figures
  are settled (the first version of this benchmark evaluated both at a
  constant 1e-3 and the dense control swung 3 points between seeds);
- the retrained 2:4 model quantized, calibrated (percentile, the QAT
  recipe of bench_quantization) and fine-tuned one epoch with QAT (masks
  kept), against the dense control fine-tuned the same extra epoch in
  float (goal: within 0.8 points);
- the step time of the sparse fit vs the dense fit: both train on the same
  batches in alternating turns (`_timing.interleaved_fit`) in this one
  run (goal: <= 10 % overhead);
- the share of weight magnitude 2:4 keeps with and without a channel
  permutation (`permute_for_sparsity` on a copy of the dense model; its
  outputs must not change), and that copy's top-1 right after one-shot
  pruning.

    python benchmarks/bench_sparsity.py [--quick]
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _common import bench_parser, markdown_table, write_results  # noqa: E402
from _timing import interleaved_fit, paired_ratio  # noqa: E402

import keras_mp  # noqa: E402
from keras_mp.datasets import load_fashion_mnist  # noqa: E402
from keras_mp.reference import (  # noqa: E402
    QAT_CALIBRATOR,
    compile_classifier,
    cosine_adam,
    fine_tune,
    reference_cnn,
)
from keras_mp.sparsity.callback import StructuredSparsity  # noqa: E402
from keras_mp.sparsity.model import strip_sparsity  # noqa: E402
from keras_mp.sparsity.permutation import permute_for_sparsity  # noqa: E402
from keras_mp.sparsity.report import sparsity_report  # noqa: E402

BATCH = 128


def top1(model, xt, yt):
    _, acc = model.evaluate(xt, yt, batch_size=1000, verbose=0)
    return round(100 * float(acc), 2)


def copy_of(model, width):
    clone = reference_cnn(width=width)
    clone.set_weights(model.get_weights())
    return compile_classifier(clone)


def prune_now(model, skip_unaligned):
    """One-shot 2:4 prune outside `fit`, to score before any retraining:
    these are the two hooks `fit` calls before its first step."""
    sparsity = StructuredSparsity(skip_unaligned=skip_unaligned)
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


def permutation_results(dense, width, xt, yt, skip_unaligned):
    """Kept |w| with and without permutation, and one-shot top-1 with it."""
    report = sparsity_report(
        dense, permutation=True, skip_unaligned=skip_unaligned
    )
    search = [r for r in report.rows if r.eligible]
    permuted = copy_of(dense, width)
    start = time.perf_counter()
    rows = {r.name: r for r in permute_for_sparsity(permuted)}
    seconds = time.perf_counter() - start
    diff = np.abs(
        permuted.predict(xt[:512], verbose=0)
        - dense.predict(xt[:512], verbose=0)
    ).max()
    # What the one-shot prune of the permuted copy kept, layer by layer.
    pruned = [
        r for r in prune_now(permuted, skip_unaligned).report.rows if r.eligible
    ]
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


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--train-images", type=int, default=60000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--chunk-steps",
        type=int,
        default=30,
        help="steps per turn when the dense and 2:4 fits alternate",
    )
    parser.add_argument("--timing-turns", type=int, default=8)
    parser.add_argument(
        "--every-layer",
        action="store_true",
        help="prune every layer whose input channels are a multiple of 4 "
        "(the callback's default, logits included) and retrain in the "
        "original channel order, instead of NVIDIA ASP's recipe "
        "(skip_unaligned=True, permute_for_sparsity first)",
    )
    parser.add_argument(
        "--seeds", type=int, default=3, help="retraining seeds (batch orders)"
    )
    args = parser.parse_args()
    if args.quick:
        args.train_images, args.epochs, args.width = 2048, 1, 16
        args.timing_turns, args.chunk_steps, args.seeds = 2, 8, 1
    (x, y), (xt, yt) = load_fashion_mnist()
    x, y = x[: args.train_images], y[: args.train_images]
    if len(x) < BATCH:
        parser.error(f"--train-images must be at least {BATCH} (one batch)")

    def cosine(model, lr, total_steps):
        """Adam with cosine decay to 0 over the run: every phase ends at a
        low learning rate, so its top-1 is settled, not a high-LR sample."""
        return compile_classifier(model, optimizer=cosine_adam(total_steps, lr))

    def train(model, seed, epochs, lr, callbacks=()):
        return fine_tune(
            model, x, y, epochs, lr, callbacks, seed, BATCH, verbose=2
        )

    start = time.perf_counter()
    keras.utils.set_random_seed(0)  # the initial weights too
    dense = train(reference_cnn(width=args.width), 0, args.epochs, args.lr)
    epoch_seconds = (time.perf_counter() - start) / args.epochs
    results = {"dense_top1": top1(dense, xt, yt)}

    skip = not args.every_layer
    one_shot = copy_of(dense, args.width)
    report = prune_now(one_shot, skip).report
    results["one_shot_top1"] = top1(one_shot, xt, yt)
    permutation = permutation_results(dense, args.width, xt, yt, skip)
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
        if not args.every_layer:
            permute_for_sparsity(sparse)
        sparsity = prune_now(sparse, skip)
        train(control, seed, args.epochs, args.lr)
        train(sparse, seed, args.epochs, args.lr, [sparsity])
        run = {
            "seed": seed,
            "dense_control_top1": top1(control, xt, yt),
            "sparse_retrained_top1": top1(sparse, xt, yt),
        }
        qat = keras_mp.quantize_model(sparse)
        keras_mp.calibrate(qat, x[:2048], method=QAT_CALIBRATOR, verbose=0)
        control_ft = copy_of(control, args.width)
        train(control_ft, seed, 1, 1e-4)
        train(qat, seed, 1, 1e-4, [StructuredSparsity(skip_unaligned=skip)])
        run["dense_control_plus_1_top1"] = top1(control_ft, xt, yt)
        run["sparse_qat_int8_top1"] = top1(qat, xt, yt)
        eligible = [qat.get_layer(r.name) for r in report.rows if r.eligible]
        run["sparse_qat_still_2_4"] = bool(eligible) and all(
            keras_mp.is_2_4_sparse(
                w.kernel.numpy(), 0 if w.kernel.ndim == 2 else -2
            )
            for w in eligible
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
    report_after = sparsity.report
    results["all_pruned_layers_2_4"] = all(
        r.pattern_valid for r in report_after.rows if r.eligible
    )
    results["strip_max_abs_diff"] = float(
        np.abs(
            stripped.predict(xt[:512], verbose=0)
            - sparse.predict(xt[:512], verbose=0)
        ).max()
    )

    # Step time: the dense control and the 2:4 model (with its callback)
    # train on the same batches in alternating turns (see _timing), so the
    # machine's drift hits both; the overhead is the median of the per-turn
    # ratios of the median step.
    timing_steps = min(args.timing_turns * args.chunk_steps, len(x) // BATCH)
    xs, ys = x[: timing_steps * BATCH], y[: timing_steps * BATCH]
    for model in (control, sparse):
        cosine(model, 1e-4, timing_steps)
    timers = interleaved_fit(
        {"dense": (control, []), "sparse": (sparse, [sparsity])},
        xs,
        ys,
        BATCH,
        timing_steps,
        args.chunk_steps,
    )
    turns, per_turn, of_medians = paired_ratio(timers, "dense", "sparse")
    overhead = 100 * (per_turn - 1)
    results["step_ms_median"] = {
        k: round(1000 * t.median(), 2) for k, t in timers.items()
    }
    results["step_overhead_percent"] = round(overhead, 1)
    results["step_overhead_percent_of_medians"] = round(
        100 * (of_medians - 1), 1
    )
    results["turn_ratios"] = [round(r, 3) for r in turns]
    results["dense_epoch_seconds"] = round(epoch_seconds, 1)
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
        f"test images. Every phase: Adam, learning rate cosine-decayed to 0 "
        f"from {args.lr} (E-epoch phases) or 1e-4 (the 1-epoch QAT and its "
        f"control), so each figure is taken at the end of a decayed run. "
        f"A dense epoch took {results['dense_epoch_seconds']} s. "
        + (
            "Pruned: every layer whose input channels are a multiple of 4, "
            "original channel order (`--every-layer`)."
            if args.every_layer
            else "Pruned as NVIDIA ASP does: `StructuredSparsity("
            "skip_unaligned=True)` leaves dense the layers sparse Tensor "
            "Cores do not take (output channels not a multiple of 8 or "
            "input channels not of 16), and the retrained models had "
            "`permute_for_sparsity` applied before the prune."
        )
        + "\n\n"
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
        f"Step time inside `fit`: the dense control and the 2:4 model with "
        f"its callback alternate {args.timing_turns} turns of "
        f"{args.chunk_steps} steps on the same batches; median step dense "
        f"{results['step_ms_median']['dense']} ms, 2:4 "
        f"{results['step_ms_median']['sparse']} ms; overhead {overhead:+.1f} "
        "% (median of the per-turn ratios; of the overall medians "
        f"{results['step_overhead_percent_of_medians']:+.1f} %; goal: "
        f"<= 10 %: {'PASS' if overhead <= 10 else 'FAIL'}).\n\n"
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
    write_results("sparsity", results, md, quick=args.quick)


if __name__ == "__main__":
    main()

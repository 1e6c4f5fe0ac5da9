"""The demo's report folder: plots, `results.json` and `report.md` (the
reference CNN's methods, then the ViT section)."""

import json
import os

from keras_mp.cli.demo_vit import VIT
from keras_mp.io import atomic_path, atomic_write_text
from keras_mp.precision.gpus import PRECISIONS
from keras_mp.quantization.names import NOT_QUANTIZED, canonical_name
from keras_mp.reference import QAT_CALIBRATOR


def plot_results(results, sparsity, scale_history, output):
    """The report's PNG plots; their file names (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (`pip install keras-mp[plot]`): no plots.")
        return []
    names = list(results["methods"])
    acc = [results["methods"][n]["test_top1"] for n in names]
    lat = [results["methods"][n].get("latency_ms_batch1", 0) for n in names]
    figures = {
        "accuracy.png": ("test top-1 %", acc),
        "latency.png": ("ORT CPU latency, batch 1 (ms)", lat),
    }
    written = []
    for filename, (label, values) in figures.items():
        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.bar(names, values, color="tab:blue")
        ax.set_ylabel(label)
        if "top-1" in label:
            ax.set_ylim(max(0, min(values) - 5), 100)
        ax.tick_params(axis="x", rotation=30)
        fig.tight_layout()
        with atomic_path(os.path.join(output, filename), suffix=".png") as tmp:
            fig.savefig(tmp)
        plt.close(fig)
        written.append(filename)
    layers = [r for r in sparsity.rows if r.eligible]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.bar([r.name for r in layers], [r.fraction_zero for r in layers])
    ax.set_ylabel("fraction of zero weights")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    with atomic_path(os.path.join(output, "sparsity.png"), suffix=".png") as t:
        fig.savefig(t)
    plt.close(fig)
    written.append("sparsity.png")
    if scale_history:
        fig, ax = plt.subplots(figsize=(8, 3))
        steps, scales = zip(*scale_history)
        ax.semilogy(steps, scales)
        ax.set_xlabel("step")
        ax.set_ylabel("loss scale")
        fig.tight_layout()
        with atomic_path(
            os.path.join(output, "loss_scale.png"), suffix=".png"
        ) as t:
            fig.savefig(t)
        plt.close(fig)
        written.append("loss_scale.png")
    return written


def _cell(m, key, spec):
    return format(m[key], spec) if key in m else "-"


def vit_section(vit):
    """The report's ViT section (Markdown lines) from `results["vit"]`:
    its table, or the reason the row is missing."""
    if "skipped" in vit:
        return ["## ViT (keras-hub)", "", vit["skipped"], ""]
    methods = vit["methods"]
    fp = methods["float32"]["test_top1"]
    rows = [
        "| ViT | test top-1 % | vs float32 | TensorRT lint | Q/DQ nodes | "
        "weighted ops with Q/DQ inputs | attention matmuls with Q/DQ "
        "inputs | ORT top-1 % | ORT parity top-1 % | batch-1 ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, m in methods.items():
        exported = "onnx" in m
        rows.append(
            f"| vit_{label} | {m['test_top1']:.2f} | "
            f"{m['test_top1'] - fp:+.2f} | {_cell(m, 'tensorrt_lint', 's')} | "
            f"{_cell(m, 'qdq_nodes', 'd')} | "
            + (
                f"{m['weighted_quantized']} / {m['weighted_ops']} | "
                f"{m['attention_quantized']} / {m['attention_matmuls']} | "
                if exported
                else "- | - | "
            )
            + f"{_cell(m, 'ort_test_top1', '.2f')} | "
            f"{_cell(m, 'parity_top1_agreement', '.2f')} | "
            f"{_cell(m, 'latency_ms_batch1', '.2f')} |"
        )
    extra = (
        f"QAT (from {QAT_CALIBRATOR} calibration) and `float32_control` get "
        f"{vit['qat_epochs']} more epoch(s) each (cosine-decayed from 1e-4)."
        if "qat" in methods
        else "`--quick`: float32 (not exported) and PTQ only; the full demo "
        "adds QAT and the float32 control."
    )
    return [
        "## ViT (keras-hub)",
        "",
        f"A keras-hub `ViTBackbone` ({vit['patches']} patches and a class "
        f"token, {VIT['num_layers']} layers, width {VIT['hidden_dim']}, "
        f"{VIT['num_heads']} heads, MLP {VIT['mlp_dim']}; "
        f"{vit['params']:,} weights) with a pooled Dense logits head, "
        f"trained {vit['epochs']} epoch(s) in float32 on "
        f"{vit['train_images']} images ({vit['train_seconds']} s; the whole "
        f"ViT row {vit['seconds']} s). {extra} "
        "ORT columns: ONNX Runtime with graph optimizations off on every "
        "test image; an attention matmul is a MatMul of two run-time "
        "tensors (Q x K, softmax x V).",
        "",
        "\n".join(rows),
        "",
    ]


def _clip_lines(clips):
    """Which calibrator clipped the most of one tensor's inputs."""
    if not clips:
        return []
    parts = [
        f"{m} {c['percent']:g}%"
        + (f" (`{c['quantizer']}`)" if c["percent"] > 1 else "")
        for m, c in clips.items()
    ]
    return [
        "Largest share of one tensor's calibration inputs beyond its range: "
        + ", ".join(parts)
        + " (`max` clips nothing; `calibrate` warns above 1%, as such a "
        "clip can cost accuracy).",
        "",
    ]


def _auto_lines(auto):
    """The `auto_quantize` paragraph (empty without its results)."""
    if not auto:
        return []
    # results written before the vocabulary say "float16", "fp8"
    choices = [
        (name, canonical_name(p, "choices", PRECISIONS, warn=False))
        for name, p in auto["choices"]
    ]
    counts = {}
    for _, precision in choices:
        counts[precision] = counts.get(precision, 0) + 1
    chosen = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    floats = [name for name, p in choices if p == NOT_QUANTIZED]
    return [
        f"`auto_quantize`: INT8, FP8 or float (float16) per layer, the least "
        f"predicted {auto['gpu']} latency within "
        f"{100 * auto['max_drop']:g} point of float on "
        f"{auto['eval_images']} training images (measured drop "
        f"{100 * auto['drop_on_eval_images']:+.2f}): {chosen} layers"
        + (f" (float: {', '.join(floats)})" if floats else "")
        + f", {100 * auto['quantized_flops']:.1f}% of the FLOPs quantized, "
        f"predicted speed-up over float16 "
        f"{auto['predicted_speedup_over_fp16']:.2f}x (a roofline model, "
        f"not a GPU measurement), found in {auto['seconds']} s.",
        "",
    ]


def write_report(output, results, audit, epochs, qat_epochs, learning_rate):
    """Writes `results.json` and `report.md` into `output`, each once and
    atomically (a temporary file renamed into place); `report.md` ends with
    the ViT section of `results["vit"]` (`vit_section`)."""
    fp = results["methods"]["float32"]
    rows = [
        "| method | test top-1 % | vs float32 | TensorRT lint | Q/DQ nodes | "
        "ORT parity top-1 | ORT rel. L2 | batch-1 ms | batch-64 ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, m in results["methods"].items():
        rows.append(
            f"| {label} | {m['test_top1']:.2f} | "
            f"{m['test_top1'] - fp['test_top1']:+.2f} | {m['tensorrt_lint']} | "
            f"{m['qdq_nodes']} | {m['parity_top1_agreement']:.2f}% | "
            f"{m['parity_rel_l2']:.2g} | {m['latency_ms_batch1']:.2f} | "
            f"{m['latency_ms_batch64']:.1f} |"
        )
    lines = [
        "# keras_mp demo report",
        "",
        f"Data: {results['data']}, {results['train_images']} training and "
        f"{results['test_images']} test images.",
        "",
        f"Training policy: {results['policy']['name']}. "
        f"{results['policy']['reason']}",
        f"Float training: {epochs} epoch(s), {results['train_seconds']} s. "
        f"QAT and fine-tunes: {qat_epochs} epoch(s) each, cosine-decayed "
        f"learning rate from 1e-4. `float32_control` is the float model "
        f"fine-tuned the same extra epochs (compare QAT with it). "
        f"`sparse_2_4_qat`: pruned to 2:4, retrained {qat_epochs} epoch(s) "
        f"from the training rate {learning_rate:g} (cosine), then QAT "
        f"as above, so it had one epoch more than the control. Best PTQ "
        f"calibrator (test top-1): {results['best_calibrator']}; "
        f"QAT starts from {QAT_CALIBRATOR} calibration.",
        "",
        "\n".join(rows),
        "",
        *_clip_lines(results.get("calibration_clips")),
        *_auto_lines(results.get("auto_quantize")),
        "Parity runs ONNX Runtime with graph optimizations off (Q/DQ "
        "semantics); latency uses ORT's default optimizations on this CPU, "
        "where INT8 Q/DQ graphs run slower than float32: latency here is "
        "information, not the TensorRT speed.",
        "",
    ]
    probe = results.get("loss_scale_probe")
    if probe:
        lines += [
            f"Dynamic loss scaling ({probe['steps']} mixed_float16 steps on a "
            f"copy, since this machine trains in {results['policy']['name']}): "
            f"scale {probe['initial_scale']:g} at the start, "
            f"{probe['final_scale']:g} at the end, {probe['skipped_steps']} "
            "overflow step(s) skipped (loss_scale.png).",
            "",
        ]
    lines += [
        "Tensor Core audit of the mixed_float16 build:",
        "",
        "```",
        audit.to_table(),
        "```",
        "",
    ] + [f"![{p}]({p})" for p in results["plots"]]
    vit = vit_section(results["vit"])
    lines += [""] + vit
    atomic_write_text(
        os.path.join(output, "results.json"), json.dumps(results, indent=2)
    )
    atomic_write_text(os.path.join(output, "report.md"), "\n".join(lines))
    print(f"\nReport written to {output}/report.md")
    print("\n".join(rows))
    print("\n".join(vit))

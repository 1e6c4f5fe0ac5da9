"""Rendering of the peer benchmark's results: Markdown table, plot, docs page.

Imported by `benchmarks/bench_peers.py` (main venv); works from the results
dict alone, so `bench_peers.py --render` can redraw from `peers.json`.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import markdown_table  # noqa: E402


def _fmt(v, spec="{:.2f}"):
    return "n/a" if v is None else spec.format(v)


def _kernels(kernels):
    if not kernels:
        return ""
    return f" ({sum(kernels.values())} int8 kernels)"


GOAL_TITLES = {
    "keras_mp_qat_top1_at_least_every_peer": "keras_mp QAT top-1 >= every "
    "peer's: its mean over the fine-tune orders (Keras) vs every PTQ peer "
    "(ORT, no opt.) and tfmot QAT's mean over the same orders (tf_keras); "
    "the verdict",
    "keras_mp_qat_onnx_top1_vs_every_peer_onnx_order0": "keras_mp QAT ONNX "
    "top-1 vs every peer's ONNX (ORT, no opt.), order 0 model only, for "
    "reference (the verdict is the mean one above)",
    "keras_mp_qat_vs_its_float32_control_points": "keras_mp QAT - its "
    "float32 control (Keras), mean over the fine-tune orders, for reference",
    "tfmot_qat_vs_its_float32_control_points": "tfmot QAT - its float32 "
    "control (tf_keras), mean over the fine-tune orders, for reference",
    "every_keras_mp_onnx_lint_clean": "every keras_mp ONNX passes the "
    "TensorRT lint",
    "every_keras_mp_calibrator_within_0.3_point_of_float32": "every keras_mp "
    "calibrator's PTQ test top-1 within 0.3 point of float32 (issue 25); "
    "points vs float32",
    "keras_mp_best_ptq_at_least_modelopt_best": "keras_mp's best PTQ "
    "(calibrator chosen on validation) >= ModelOpt's best PTQ, same float "
    "model and calibration images (issue 25)",
    "tfmot_and_keras_onnx_not_lint_clean": "tfmot's and Keras' own ONNX do not",
    "keras_mp_covers_every_weighted_op_with_no_more_qdq_than_modelopt": (
        "keras_mp covers every weighted op with no more Q/DQ nodes than "
        "ModelOpt"
    ),
}


def _mean_sd(mean, sd):
    return "n/a" if mean is None else f"{mean:.2f} (sd {sd:.2f})"


def _over_orders(mean, sd, per_order):
    if mean is None:
        return "not measured"
    listed = ", ".join(f"{v:.2f}" for v in per_order)
    return f"{mean:.2f} (sd {sd:.2f}; per order {listed})"


def _qat_mean_text(v):
    ptq = v["ptq_peers_top1_ort"]
    best_ptq = (
        f"{max(ptq, key=ptq.get)} {max(ptq.values()):.2f}"
        if ptq
        else "none measured"
    )
    best = v["best_peer"]
    if best == "tfmot QAT":
        best += f" mean over {v['orders']} orders"
    ours = _over_orders(
        v["keras_mp_qat_mean"],
        v["keras_mp_qat_sd"],
        v["keras_mp_qat_per_order"],
    )
    tfmot = _over_orders(
        v["tfmot_qat_mean"], v["tfmot_qat_sd"], v["tfmot_qat_per_order"]
    )
    return (
        f"keras_mp QAT {ours}; tfmot QAT {tfmot}; best PTQ peer: {best_ptq}. "
        f"keras_mp {v['keras_mp_qat_mean']:.2f} vs {v['best_peer_top1']:.2f} "
        f"({best}): {v['keras_mp_qat_mean'] - v['best_peer_top1']:+.2f} points"
    )


def _goal_row(name, v):
    title = GOAL_TITLES.get(name, name)
    if not isinstance(v, dict):
        return (title, f"{v:+.2f} points", "")
    if "mean_points" in v:
        return (
            title,
            f"{v['mean_points']:+.2f} points (sd {v['sd_points']:.2f}) over "
            f"{v['orders']} orders; per order: "
            + ", ".join(f"{g:+.2f}" for g in v["per_order_points"]),
            "",
        )
    verdict = "PASS" if v["pass"] else "FAIL"
    if "reason" in v:
        text = v["reason"]
    elif "keras_mp_qat_mean" in v:
        text = _qat_mean_text(v)
    elif "best_peer" in v:
        text = (
            f"{v['keras_mp_qat']:.2f} vs {v['best_peer_top1']:.2f} "
            f"({v['best_peer']}): "
            f"{v['keras_mp_qat'] - v['best_peer_top1']:+.2f} points"
        )
    elif "keras_mp_qdq" in v:
        text = (
            f"keras_mp {', '.join(v['keras_mp_weighted_covered'])} weighted "
            f"ops, {v['keras_mp_qdq']} Q/DQ nodes; ModelOpt "
            f"{', '.join(v['modelopt_weighted_covered'])}, "
            f"{v['modelopt_qdq']} Q/DQ nodes"
        )
    elif "modelopt" in v:
        text = f"keras_mp {v['keras_mp']} vs {v['modelopt']}"
    elif isinstance(v.get("measured"), dict) and all(
        isinstance(x, bool) for x in v["measured"].values()
    ):
        text = ", ".join(
            f"{k} {'PASS' if ok else 'FAIL'}" for k, ok in v["measured"].items()
        )
    elif isinstance(v.get("measured"), dict):
        text = ", ".join(f"{k} {x:+.2f}" for k, x in v["measured"].items())
    elif isinstance(v.get("measured"), list):
        text = ", ".join("PASS" if ok else "FAIL" for ok in v["measured"])
    else:
        text = json.dumps({k: x for k, x in v.items() if k != "pass"})
    return (title, text, verdict)


ORDER_COLUMNS = (
    ("keras_mp", "control", "keras_mp float32 control"),
    ("keras_mp", "qat", "keras_mp QAT"),
    ("tfmot", "control", "tfmot float32 control"),
    ("tfmot", "qat", "tfmot QAT"),
)


def orders_table(results):
    """Keras top-1 of both QAT tools and their controls per fine-tune order,
    then mean (sd); no lines when neither tool ran."""
    runs = {
        tool: (results.get(tool) or {}).get("runs", [])
        for tool in ("keras_mp", "tfmot")
    }
    n = max(len(r) for r in runs.values())
    if not n:
        return []

    def cell(tool, name, k):
        r = runs[tool]
        return _fmt(r[k][f"{name}_keras_test_top1"] if k < len(r) else None)

    def mean_cell(tool, name):
        s = (results.get(tool) or {}).get(name, {})
        return _mean_sd(
            s.get("keras_test_top1_mean"), s.get("keras_test_top1_sd")
        )

    body = [
        (str(k), *(cell(t, name, k) for t, name, _ in ORDER_COLUMNS))
        for k in range(n)
    ]
    body.append(("mean", *(mean_cell(t, name) for t, name, _ in ORDER_COLUMNS)))
    header = ("fine-tune order", *(label for _, _, label in ORDER_COLUMNS))
    return [
        "",
        f"QAT and control over {n} fine-tune orders: test top-1 % in each "
        "tool's own framework (Keras 3 for keras_mp, tf_keras for tfmot); "
        "order 0's models are the QAT and control rows of the first table.",
        "",
        markdown_table(header, body),
    ]


def _finetune_text(c):
    return (
        f"QAT and controls: 1 epoch, {c['finetune']}, each fine-tuned afresh "
        f"on {c['qat_seeds']} fine-tune orders (order 0: one fixed shuffle of "
        "the training images; order k: that shuffle permuted with seed k; "
        f"seed {c['seed']} + 1 + k), the same batches in the same order for "
        "every tool within an order. The table's QAT and control rows, their "
        "ONNX and train-step figures are the order-0 models."
    )


def _qat_goal_note(g):
    v = g.get("keras_mp_qat_top1_at_least_every_peer")
    if not (isinstance(v, dict) and "orders" in v):
        return []
    return [
        "",
        f"The QAT verdict: {v['how']} That parity: {v['keras_mp_qat_parity']}."
        + (
            " Test top-1 of the order-0 keras_mp QAT model, Keras minus ONNX "
            f"Runtime: {gap:+.2f} points."
            if (gap := v.get("keras_mp_qat_keras_minus_onnx_order0_points"))
            is not None
            else ""
        ),
    ]


def markdown(results):
    rows = results["rows"]
    table = []
    errors = []
    for r in rows:
        lint, lat = r["lint"], r["latency"] or {}
        if lint:
            verdict = (
                "PASS"
                if lint["ok"]
                else (
                    "FAIL: "
                    + ", ".join(
                        f"{k} x{v}" for k, v in lint["violation_rules"].items()
                    )
                )
            )
            qdq = str(lint["num_qdq"])
            covered = f"{lint['weighted_ops_quantized']}/{lint['weighted_ops']}"
            if lint["qoperator_ops"]:
                covered += (
                    " (+"
                    + ", ".join(
                        f"{v} {k}" for k, v in lint["qoperator_ops"].items()
                    )
                    + ")"
                )
        else:
            verdict, qdq, covered = "n/a", "n/a", "n/a"
        if r["error"]:
            errors.append((r["label"], r["error"]))
        table.append(
            (
                r["label"] + (" (failed)" if r["error"] and not lint else ""),
                _fmt(r["test_top1_ort_reference"]),
                _fmt(r["test_top1_ort_optimized"])
                + _kernels(r.get("ort_integer_kernels")),
                _fmt(r["test_top1_keras"]),
                verdict,
                qdq,
                covered,
                _fmt(lat.get("ratio_batch1"), "{:.2f}x"),
                _fmt(lat.get("ratio_batch64"), "{:.2f}x"),
                _fmt(r["train_step_ratio"], "{:.2f}x")
                + (
                    f" (CPU {r['train_step_cpu_ratio']:.2f}x)"
                    if r.get("train_step_cpu_ratio")
                    else ""
                ),
            )
        )
    header = (
        "model",
        "top-1 % (ORT, no opt.)",
        "top-1 % (ORT default opt.)",
        "top-1 % (Keras)",
        "TensorRT lint",
        "Q/DQ nodes",
        "weighted ops with Q/DQ inputs",
        "ORT latency / fp32, batch 1",
        "batch 64",
        "train step / fp32",
    )
    c = results["config"]
    float_ = results["float32"]
    ev = [r for r in rows if r["label"] == "float32"][0]
    lat = ev["latency"] or {}
    lines = [
        f"Reference CNN (`keras_mp.reference.reference_cnn`, width "
        f"{c['width']}, {float_.get('parameters', '?')} parameters), trained "
        f"once in float32 for {c['float_epochs']} epoch(s) on "
        f"{c['train_images']} Fashion-MNIST training images; "
        f"{c['val_images']} held-out training images are the validation "
        f"slice (keras_mp's calibrator choice); {c['calib_images']} training "
        "images calibrate every PTQ tool; top-1 on "
        f"{c['test_images'] or '?'} test images. " + _finetune_text(c),
        "",
        markdown_table(header, table),
        "",
        "- top-1 (ORT, no opt.): ONNX Runtime with graph optimizations "
        "disabled, i.e. the Q/DQ graph's own semantics. With its default "
        "optimizations ORT turns a DequantizeLinear -> Conv/Gemm -> "
        "QuantizeLinear pattern into its own integer kernels (QLinearConv, "
        "QGemm; counted in brackets), which saturate on CPUs without VNNI "
        "(docs/export.md); graphs with Q/DQ only on the inputs of weighted "
        "ops keep float Conv/Gemm there. Keras: the tool's own model in "
        "Keras 3 / tf_keras.",
        "- TensorRT lint: `keras_mp.check_tensorrt`; the rules it broke, "
        "with counts. Weighted ops: Conv/ConvTranspose/MatMul/Gemm with "
        "both inputs behind a DequantizeLinear (QOperator ops are not "
        "counted as weighted).",
        f"- Latency: {c['latency_method']}. float32: "
        f"{_fmt(lat.get('ms_batch1'), '{:.3f}')} ms at batch 1, "
        f"{_fmt(lat.get('ms_batch64'), '{:.2f}')} ms at batch 64. "
        "CPU latency is information only: TensorRT, not ORT's CPU provider, "
        "is the target.",
        "- Train step: `train_on_batch` (batch 128) of the QAT model / of "
        "its own float32 twin (Keras 3 for keras_mp, tf_keras for tfmot), "
        "interleaved rounds in one process; median wall time per call, "
        "and in brackets the same ratio in process CPU time, which other "
        "processes on a shared machine disturb less.",
    ]
    notes = [(r["label"], r["note"]) for r in rows if r["note"]]
    if notes:
        lines += ["", "Notes:", ""] + [f"- {k}: {v}" for k, v in notes]
    lines += orders_table(results)
    calibrators = results.get("calibrators") or {}
    if calibrators:
        lines += [
            "",
            "PTQ by calibrator, test top-1 % (keras_mp in Keras, its ONNX "
            "matching; ModelOpt and ORT in ONNX Runtime without "
            "optimizations), same float model and 2048 calibration images:",
            "",
            markdown_table(
                ("calibrator", "top-1 %", "vs float32"),
                [
                    (
                        k,
                        f"{v:.2f}",
                        ""
                        if k == "float32" or "float32" not in calibrators
                        else f"{v - calibrators['float32']:+.2f}",
                    )
                    for k, v in calibrators.items()
                ],
            ),
        ]
    g = results["goals"]
    goal_rows = [_goal_row(name, v) for name, v in g.items()]
    lines += [
        "",
        "Goals (issues 7 and 25), as measured:",
        "",
        markdown_table(("goal", "measured", "result"), goal_rows),
        *_qat_goal_note(g),
    ]
    if errors:
        lines += ["", "Failures and errors, verbatim (tail):", ""]
        for label, e in errors:
            lines += [
                f"- {label}:",
                "",
                "  ```",
                *["  " + ln for ln in str(e).splitlines()[-8:]],
                "  ```",
            ]
    return "\n".join(lines)


def plot(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return None
    from keras_mp.io import atomic_path

    rows = [
        r
        for r in results["rows"]
        if r["test_top1_ort_reference"] is not None
        or r["test_top1_keras"] is not None
    ]
    labels = [
        r["label"].replace(" (keras_mp.export_onnx)", "\n(kmp export)")
        for r in rows
    ]
    acc = [
        r["test_top1_ort_reference"]
        if r["test_top1_ort_reference"] is not None
        else r["test_top1_keras"]
        for r in rows
    ]
    colors = [
        "tab:gray"
        if not r["lint"]
        else (
            "tab:green"
            if r["lint"]["ok"] and r["lint"]["num_qdq"]
            else "tab:blue"
            if r["lint"]["ok"]
            else "tab:red"
        )
        for r in rows
    ]
    lat1 = [(r["latency"] or {}).get("ratio_batch1") or 0 for r in rows]
    lat64 = [(r["latency"] or {}).get("ratio_batch64") or 0 for r in rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 7.5), sharex=True)
    bars = ax1.bar(range(len(rows)), acc, color=colors)
    for b, v in zip(bars, acc):
        ax1.text(
            b.get_x() + b.get_width() / 2,
            v + 0.1,
            f"{v:.2f}",
            ha="center",
            va="bottom",
            fontsize=7,
        )
    lo = min(acc)
    ax1.set_ylim(max(0, lo - 2), min(100, max(acc) + 3))
    ax1.set_ylabel("test top-1 %")
    from matplotlib.patches import Patch

    ax1.legend(
        handles=[
            Patch(color="tab:blue", label="float32 (ONNX)"),
            Patch(color="tab:gray", label="float32 control (Keras, no ONNX)"),
            Patch(color="tab:green", label="INT8, TensorRT lint PASS"),
            Patch(color="tab:red", label="INT8, TensorRT lint FAIL"),
        ],
        fontsize=8,
        loc="upper left",
        ncol=2,
    )
    ax1.set_title(
        "Fashion-MNIST test top-1 (ONNX Runtime, graph optimizations off)",
        fontsize=10,
    )
    x = range(len(rows))
    ax2.bar([i - 0.2 for i in x], lat1, width=0.4, label="batch 1")
    ax2.bar([i + 0.2 for i in x], lat64, width=0.4, label="batch 64")
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set_ylabel("ORT CPU latency / float32")
    ax2.legend(fontsize=8)
    ax2.set_xticks(list(x))
    ax2.set_xticklabels(labels, rotation=35, ha="right", fontsize=8)
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return path


def _versions_lines(results):
    main = ", ".join(f"{k} {v}" for k, v in results["versions"].items())
    lines = [f"- main venv: {main}"]
    for venv, pkgs in results.get("side_venvs", {}).items():
        shown = ", ".join(f"{k} {v}" for k, v in pkgs.items())
        lines.append(f"- `benchmarks/{venv}`: {shown}")
    return lines


def _rerun_lines(rerun):
    if not rerun:
        return []
    return [
        "",
        f"Steps run again with `--rerun` ({rerun['seconds']:.0f} s): "
        f"{', '.join(rerun['steps'])}, then the evaluation; every other "
        "step (the float model, the other tools) is the full run's, "
        f"`{rerun.get('full_run_command', 'python benchmarks/bench_peers.py')}`"
        ".",
    ]


def results_markdown(results):
    """`peers.md`: command, versions, run time, then the tables."""
    return "\n".join(
        [
            f"Command: `{results['command']}`",
            "",
            "Versions:",
            "",
            *_versions_lines(results),
            "",
            f"Total run time: {results['total_seconds']:.0f} s.",
            *_rerun_lines(results.get("rerun")),
            "",
            markdown(results),
            "",
        ]
    )


def write_outputs(results, out_dir, docs_path=None):
    """Writes peers.json, peers.md, peers.png (and the docs page) atomically."""
    from keras_mp.io import atomic_write_text

    os.makedirs(out_dir, exist_ok=True)
    text = results_markdown(results)
    atomic_write_text(
        os.path.join(out_dir, "peers.json"), json.dumps(results, indent=2)
    )
    atomic_write_text(os.path.join(out_dir, "peers.md"), text)
    plot(results, os.path.join(out_dir, "peers.png"))
    if docs_path:
        atomic_write_text(docs_path, update_docs_page(docs_path, results))
    return text


HOW_RUN = """\
- **keras_mp** (main venv, Keras 3): `keras_mp.quantize_model` +
  `keras_mp.calibrate` with each calibrator (max, percentile, entropy,
  mse); the PTQ row is the one with the best top-1 on the validation slice
  (the test set never picks anything). QAT fine-tunes a copy calibrated
  with percentile, keras_mp's documented QAT recipe (chosen in
  `bench_quantization.py` on one fine-tune seed, on this same Fashion-MNIST
  test set, so this row is not blind to it); the float32 control
  fine-tunes the float model the same way. Exported with
  `keras_mp.export_onnx` (ONNX Runtime parity checked).
- **ONNX Runtime** `quantize_static` on the float ONNX, after ORT's
  `quant_pre_process` (with `skip_symbolic_shape=True`): `QuantFormat.QDQ`,
  `QuantType.QInt8` for weights and activations, `per_channel=True`,
  `extra_options={"ActivationSymmetric": True, "WeightSymmetric": True}`,
  the rest at its defaults; MinMax, Entropy and Percentile calibration.
  `ORT minmax_nobias` is one extra variant, not a default: MinMax plus
  `QuantizeBias=False`.
- **NVIDIA ModelOpt** in its own venv (it pulls PyTorch):
  `python -m modelopt.onnx.quantization --onnx_path=float.onnx
  --quantize_mode=int8 --calibration_data_path=calib.npz
  --calibration_method=entropy|max --calibration_eps cpu
  --high_precision_dtype fp32 --output_path=...` (`cpu`: no GPU here;
  `fp32`: by default ModelOpt casts the rest of an fp32 graph to fp16,
  every other row keeps float32 there).
- **tfmot** in its own venv (tfmot takes only tf_keras models, and
  importing it switches the process to legacy Keras): a tf_keras twin of
  the same architecture gets the float weights layer by layer (its test
  top-1 is checked against the Keras 3 model's), then
  `tfmot.quantization.keras.quantize_model` and the same fine-tune; its
  own float twin, fine-tuned the same way, is its control. Exported with
  `tf2onnx.convert.from_keras`.
- **Keras 3** `model.quantize("int8")` on a copy of the float model (no
  calibration data), exported with Keras' own
  `model.export(format="onnx")`; `keras_mp.export_onnx` of the same model
  is noted beside it.
"""

BEGIN = (
    "<!-- bench_peers:begin. Generated by `python benchmarks/bench_peers.py` "
    "(template: benchmarks/peers/render.py); edits here are overwritten. -->"
)
END = "<!-- bench_peers:end -->"
TITLE = "## keras_mp vs the tools people use today"


def docs_section(results):
    """The peers section of `docs/benchmarks.md`, markers included."""
    c = results["config"]
    cpu = results.get("total_cpu_seconds")
    load = results.get("load_average_at_end")
    timing = f"{results['total_seconds'] / 60:.0f} min wall"
    if cpu:
        timing += f", {cpu / 60:.0f} min CPU"
    if load:
        timing += f"; load average at the end {load[0]:.1f} on 2 cores"
    return "\n".join(
        [
            BEGIN,
            TITLE,
            "",
            "Measured side by side in one run, each tool in its own "
            "process, all starting from the same float32 Keras model. The "
            "plot of this table is `benchmarks/results/peers.png`; every "
            "number is in `benchmarks/results/peers.json`.",
            "",
            markdown(results),
            "",
            "### How each tool was run",
            "",
            HOW_RUN,
            "### Reproduce",
            "",
            "```bash",
            "python benchmarks/bench_peers.py --setup  # once: the two side "
            "venvs",
            f"{results['command']}  # this run: {timing}",
            "python benchmarks/bench_peers.py --quick  # small subset; "
            "writes only into the work folder",
            "python benchmarks/bench_peers.py --render  # redraw the table, "
            "plot and this section from peers.json",
            "```",
            "",
            f"Models, ONNX files and per-tool logs of this run: "
            f"`{c['workdir']}` (`--workdir`). `--setup` creates "
            "`benchmarks/.venv-modelopt` (`pip install torch==2.13.0`, the "
            "local CPU build, first; then `pip install "
            '"nvidia-modelopt[onnx]"`) and `benchmarks/.venv-tfmot` '
            "(`tensorflow-cpu==2.21.0 tf-keras==2.21.0 "
            "tensorflow-model-optimization==0.8.1 tf2onnx==1.17.0 onnx "
            "onnxruntime==1.32.0`); both are gitignored. Without them the "
            "ModelOpt and tfmot rows record the missing environment as "
            "their error.",
            "",
            "Package versions of this run:",
            "",
            *_versions_lines(results),
            "",
            END,
        ]
    )


def update_docs_page(path, results):
    """Replaces the marked peers section of the page (or the section under
    its title up to the next `## `, or appends it); the rest is kept."""
    section = docs_section(results)
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    if BEGIN.split(".")[0] in text and END in text:
        start = text.index(BEGIN.split(".")[0])
        end = text.index(END) + len(END)
    elif TITLE in text:
        start = text.index(TITLE)
        nxt = text.find("\n## ", start + len(TITLE))
        end = nxt + 1 if nxt >= 0 else len(text)
        section += "\n"
    else:
        start = end = len(text)
        section = "\n" + section + "\n"
    if end < len(text) and not text[end:].startswith("\n"):
        section += "\n"
    return text[:start] + section + text[end:]

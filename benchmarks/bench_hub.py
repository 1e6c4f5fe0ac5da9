"""Every keras-hub backbone class end to end: one row per class.

Each `keras_hub.models.*Backbone` class of `hub_models.BACKBONES` (tiny:
2 layers, hidden 32, 2 heads, vocabulary 100, 16 tokens; 32x32 images
where the architecture allows) is built from a config with seed 0, then:

1. `keras_mp.quantize_model` and `keras_mp.calibrate` (max) on 32 random
   inputs of the model's own format (`hub_models.inputs_for`: token ids
   and padding masks, segment ids, images, audio features; dict inputs);
2. one QAT train step: Adam on the mean square of every float output
   (no head: the same loss for every backbone), ok when the loss is
   finite and a trainable weight moved;
3. `.keras` round trip with `safe_mode=True`: ok when the reloaded model
   gives bit-identical outputs on 8 other inputs;
4. `keras_mp.export_onnx` INT8 (lint violations allowed, so they are
   counted instead of stopping the row), `keras_mp.check_tensorrt`:
   violations and warnings by rule, Conv/ConvTranspose/MatMul/Gemm nodes
   with a DequantizeLinear on both inputs out of all (goal >= 95%,
   attention matmuls count), Q/DQ nodes;
5. ONNX Runtime parity on the 8 inputs (`keras_mp.verify_onnx`, graph
   optimizations off): max |diff| and relative L2, pass at <= 1e-2;
6. ModelOpt (`--modelopt VENV`, default `bench_zoo.MODELOPT_VENV`): its
   ONNX PTQ (int8, max calibration on the same 32 inputs) of the float
   ONNX keras_mp exports of the same model, counted by the same lint.

A stage that fails records the first line of its error and the row goes
on; a class not built (`hub_models.SKIPPED`) gets its reason. Every row
runs in this process, with `keras.backend.clear_session()` between rows.

    python benchmarks/bench_hub.py [--quick] [--only NAME ...]
        [--modelopt VENV | --no-modelopt] [--merge]
"""

import json
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_mp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import hub_models  # noqa: E402
from _common import (  # noqa: E402
    RESULTS,
    add_modelopt,
    add_only,
    bench_parser,
    command_line,
    markdown_table,
    modelopt_venv,
    write_results,
)
from bench_zoo import (  # noqa: E402
    COVERAGE_GOAL,
    MODELOPT_VENV,
    _first_line,
    measure_modelopt,
    placement,
    refresh_batchnorm,
)

CALIBRATION = 32
SAMPLES = 8
MAX_REL_L2 = 1e-2
# One backbone per distinct attention implementation (docs/keras_hub.md):
# Keras MultiHeadAttention, keras-hub's cached MHA, the "hooks" kind
# (Llama), Gemma, T5, DeBERTaV3, T5Gemma, and a convolutional backbone.
QUICK = [
    "BertBackbone",
    "GPT2Backbone",
    "LlamaBackbone",
    "GemmaBackbone",
    "T5Backbone",
    "DebertaV3Backbone",
    "T5GemmaBackbone",
    "ResNetBackbone",
]


def _float_outputs(outputs):
    return [
        o
        for o in keras.tree.flatten(outputs)
        if "float" in str(keras.backend.standardize_dtype(o.dtype))
    ]


def qat_step(model, x):
    """One Adam step on the mean square of `model`'s float outputs.

    Returns:
        `(loss, moved)`: the loss before the step and whether any
        trainable weight changed.
    """
    import tensorflow as tf

    optimizer = keras.optimizers.Adam(1e-3)
    weights = model.trainable_variables
    before = [w.numpy().copy() for w in weights]
    with tf.GradientTape() as tape:
        outputs = _float_outputs(model(x, training=True))
        loss = tf.add_n(
            [tf.reduce_mean(tf.square(tf.cast(o, "float32"))) for o in outputs]
        )
    grads = tape.gradient(loss, weights)
    pairs = [(g, w) for g, w in zip(grads, weights) if g is not None]
    optimizer.apply_gradients(pairs)
    moved = any(
        not np.array_equal(w.numpy(), b) for w, b in zip(weights, before)
    )
    return float(loss), moved


def _outputs(model, x):
    return [np.asarray(o) for o in keras.tree.flatten(model(x))]


def measure(name, directory, modelopt_venv=None):
    """Builds keras-hub backbone class `name` (`hub_models.BACKBONES`) and
    runs it through quantize -> calibrate -> QAT step -> `.keras` round
    trip -> INT8 export -> lint -> ONNX Runtime parity (-> ModelOpt).

    Returns:
        dict: one row; `error` names the first stage that failed.
    """
    row = {
        "class": name,
        "attention": None,
        "params": None,
        "build_ok": False,
        "qat_ok": None,
        "round_trip_ok": None,
        "export_ok": None,
        "error": None,
        "stage": None,
    }
    start = time.perf_counter()
    stage = "build"
    try:
        keras.utils.set_random_seed(0)
        model = hub_models.BACKBONES[name]()
        x = hub_models.inputs_for(model, CALIBRATION, seed=0)
        x_test = hub_models.inputs_for(model, SAMPLES, seed=1)
        refresh_batchnorm(model, x)
        model(x_test)
        row.update(
            build_ok=True,
            params=int(model.count_params()),
            attention=hub_models.attention_classes(model),
        )
        stage = "quantize"
        qmodel = keras_mp.quantize_model(model)
        stage = "calibrate"
        keras_mp.calibrate(qmodel, x, verbose=0)
        stage = "qat"
        loss, moved = qat_step(qmodel, keras.tree.map_structure(_head, x))
        row["qat_loss"] = loss
        row["qat_ok"] = bool(np.isfinite(loss) and moved)
        stage = "round trip"
        path = os.path.join(directory, f"{name}.keras")
        qmodel.save(path)
        loaded = keras.saving.load_model(path, safe_mode=True)
        want = _outputs(qmodel, x_test)
        got = _outputs(loaded, x_test)
        row["round_trip_ok"] = all(
            np.array_equal(g, w) for g, w in zip(got, want)
        )
        del loaded
        stage = "export"
        onnx_path = os.path.join(directory, f"{name}_int8.onnx")
        keras_mp.export_onnx(
            qmodel, onnx_path, overwrite=True, allow_lint_violations=True
        )
        row["export_ok"] = True
        stage = "lint"
        found = placement(onnx_path)
        row.update(found)
        stage = "parity"
        parity = keras_mp.verify_onnx(
            qmodel, onnx_path, x_test, min_top1_agreement=0.0, max_rel_l2=1e9
        )
        row.update(
            max_abs_diff=float(parity.max_abs_diff),
            rel_l2=float(parity.rel_l2),
            parity_ok=bool(parity.rel_l2 <= MAX_REL_L2),
        )
        stage = None
        if modelopt_venv is not None:
            stage = "float export (for ModelOpt)"
            float_path = os.path.join(directory, f"{name}_float.onnx")
            keras_mp.export_onnx(model, float_path, overwrite=True)
            stage = None
            row.update(measure_modelopt(float_path, x, modelopt_venv))
    except Exception as error:  # a finding, recorded in the row
        row["error"] = _first_line(error)
        row["stage"] = stage
        if stage == "export":
            row["export_ok"] = False
    row["seconds"] = time.perf_counter() - start
    return row


def _head(a):
    # The QAT step runs on 8 of the calibration inputs.
    return a[:SAMPLES]


# Why a class's weighted ops stay float, by what computes them (read from
# keras-hub 0.32's source, `keras_hub/src/models/<path>`).
WHY_FLOAT = {
    "BloomAttention": "attention inline in `call` with the ALiBi bias "
    "(`bloom/bloom_attention.py`): not reached",
    "FalconAttention": "attention inline in `call` "
    "(`falcon/falcon_attention.py`): not reached",
    "GptOssAttention": "own `_compute_attention`, sink logits concatenated "
    "to the scores (`gpt_oss/gpt_oss_attention.py`): not reached; MoE "
    "expert kernels are raw weights, no layer type "
    "(`gpt_oss/gpt_oss_decoder.py`)",
    "EsmSelfAttention": "`ops.dot_product_attention` "
    "(`esm/esm_attention.py`): no hook between its matmuls",
    "RoformerAttention": "`ops.dot_product_attention` "
    "(`roformer_v2/roformer_v2_attention.py`): no hook between its matmuls",
    "DINOV3Attention": "`ops.nn.dot_product_attention` "
    "(`dinov3/dinov3_layers.py`): no hook between its matmuls",
    "SegFormerMultiheadAttention": "attention inline in `call` "
    "(`mit/mit_layers.py`): not reached",
    "WindowAttention": "attention inline in `call` with a relative bias "
    "table (`swin_transformer/swin_transformer_layers.py`): not reached",
    "MultiHeadAttentionWithRelativePE": "attention inline in `call`, "
    "decomposed relative positions (`vit_det/vit_layers.py`): not reached",
    "VideoPrismAttention": "attention inline in `call` "
    "(`video_prism/video_prism_layers.py`): not reached",
    "PaliGemmaVitAttention": "the ViT's attention inline in `call` "
    "(`pali_gemma/pali_gemma_vit.py`): not reached",
    "TwoStreamRelativeAttention": "a `MultiHeadAttention` subclass with its "
    "own `call` (content, position and segment einsums inline, "
    "`xlnet/relative_attention.py`): `_compute_attention` is never called",
}
# Float weighted ops that are not attention, by backbone class.
WHY_FLOAT_OTHER = {
    "CLIPBackbone": "the head's `ops.matmul` of the normalized text and "
    "image embeddings (`clip/clip_layers.py`, `CLIPHead`): two activations",
    "MetaCLIP2Backbone": "the head's `ops.matmul` of the normalized text "
    "and image embeddings (`metaclip_2/metaclip_2_layers.py`): two "
    "activations",
    "SigLIPBackbone": "the head's `ops.matmul` of the normalized text and "
    "image embeddings (`siglip/siglip_layers.py`): two activations",
    "MixtralBackbone": "MoE expert kernels: raw weights of the MoE layer, "
    "no layer type (`mixtral/mixtral_decoder.py`)",
    "QwenMoeBackbone": "MoE expert kernels: raw weights of the MoE layer, "
    "no layer type (`qwen_moe/qwen_moe_decoder.py`)",
    "Qwen3MoeBackbone": "MoE expert kernels: raw weights of the MoE layer, "
    "no layer type (`qwen3_moe/qwen3_moe_decoder.py`)",
    "Qwen3_5MoeBackbone": "MoE expert kernels: raw weights of the MoE "
    "layer, no layer type (`qwen3_5_moe/qwen3_5_moe_decoder.py`)",
    "MoonshineBackbone": "the rotary embeddings' MatMul of two position-only "
    "tensors (`moonshine/moonshine_layers.py`)",
    "SmolLMBackbone": "the rotary embedding's MatMul of two position-only "
    "tensors (`smollm3/smollm3_layers.py`)",
    "SmolLM3Backbone": "the rotary embedding's MatMul of two position-only "
    "tensors (`smollm3/smollm3_layers.py`)",
}


def why_float(row):
    """Why `row`'s float weighted ops stay float: its attention classes'
    entries of `WHY_FLOAT`, and its own of `WHY_FLOAT_OTHER`."""
    if not row.get("left_float"):
        return "-"
    reasons = [
        f"`{a}`: {WHY_FLOAT[a]}"
        for a in row.get("attention") or []
        if a in WHY_FLOAT
    ]
    if row["class"] in WHY_FLOAT_OTHER:
        reasons.append(WHY_FLOAT_OTHER[row["class"]])
    return "; ".join(reasons) or "not yet explained"


def doc_table(rows):
    """The per-class table of docs/keras_hub.md."""
    lines = []
    for row in rows:
        if row.get("skipped"):
            lines.append(
                [f"`{row['class']}`", "-", f"not built: {row['skipped']}", "-"]
            )
            continue
        if not row.get("weighted_ops"):
            stage = row.get("stage") or "?"
            lines.append(
                [
                    f"`{row['class']}`",
                    ", ".join(f"`{a}`" for a in row.get("attention") or [])
                    or "none",
                    f"{stage} failed: {_short(row.get('error'))}",
                    "-",
                ]
            )
            continue
        lines.append(
            [
                f"`{row['class']}`",
                ", ".join(f"`{a}`" for a in row.get("attention") or [])
                or "none",
                f"{row['weighted_quantized']}/{row['weighted_ops']} "
                f"({100 * row['coverage']:.0f}%)",
                why_float(row),
            ]
        )
    header = ["class", "attention class", "behind Q/DQ", "left float, why"]
    return markdown_table(header, lines)


DOC = os.path.join(os.path.dirname(HERE), "docs", "keras_hub.md")
DOC_BEGIN = "<!-- bench_hub:begin. Generated by benchmarks/bench_hub.py -->"
DOC_END = "<!-- bench_hub:end -->"


def render_doc(rows, page=DOC):
    """Rewrites the per-class table of docs/keras_hub.md (between its
    `bench_hub` markers) from `rows`."""
    from keras_mp.io import atomic_write_text

    with open(page) as f:
        text = f.read()
    head = text[: text.index(DOC_BEGIN) + len(DOC_BEGIN)]
    tail = text[text.index(DOC_END) :]
    atomic_write_text(page, f"{head}\n\n{doc_table(rows)}\n\n{tail}")


def measure_modelopt_only(name, directory, venv):
    """ModelOpt's pass alone for class `name`: the same float backbone and
    calibration inputs as `measure`, its float ONNX, ModelOpt's PTQ of it.

    Returns:
        dict: `class`, `modelopt_only` (True: merged into the row of a
        full run) and the keys of `bench_zoo.measure_modelopt`.
    """
    row = {"class": name, "modelopt_only": True}
    try:
        keras.utils.set_random_seed(0)
        model = hub_models.BACKBONES[name]()
        x = hub_models.inputs_for(model, CALIBRATION, seed=0)
        refresh_batchnorm(model, x)
        path = os.path.join(directory, f"{name}_float.onnx")
        keras_mp.export_onnx(model, path, overwrite=True)
        row.update(measure_modelopt(path, x, venv))
    except Exception as error:  # a finding, recorded in the row
        row["modelopt_error"] = f"float export: {_first_line(error)}"
    return row


def _skipped(name, reason):
    return {"class": name, "skipped": reason, "build_ok": False}


def _short(text, limit=200):
    text = str(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _yes(value):
    return {True: "yes", False: "**no**", None: "-"}[value]


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def _lint_text(row):
    if row.get("lint_ok") is None:
        return "-"
    rules = ", ".join(f"{k} {v}" for k, v in row["warnings"].items())
    verdict = "PASS" if row["lint_ok"] else f"FAIL ({row['violations']})"
    return verdict + (f"; {rules}" if rules else "")


def _modelopt_text(row):
    if "modelopt_error" not in row and "modelopt_qdq_nodes" not in row:
        return "not run"
    if row.get("modelopt_error"):
        return f"not run: {row['modelopt_error']}"
    return (
        f"{row.get('qdq_nodes', '-')} / {row['modelopt_qdq_nodes']} "
        f"({100 * row['modelopt_coverage']:.0f}%)"
    )


def table(rows):
    header = [
        "class",
        "attention class",
        "build",
        "QAT step",
        ".keras",
        "export",
        "behind Q/DQ",
        "Q/DQ nodes: keras_mp / ModelOpt (its coverage)",
        "lint",
        "ORT max abs diff (rel. L2)",
        "s",
    ]
    lines = []
    for row in rows:
        if row.get("skipped"):
            reason = f"not built: {row['skipped']}"
            lines.append([f"`{row['class']}`", "-", reason] + ["-"] * 8)
            continue
        coverage = "-"
        if row.get("weighted_ops"):
            coverage = (
                f"{row['weighted_quantized']}/{row['weighted_ops']} "
                f"({100 * row['coverage']:.0f}%)"
            )
            if row.get("small_gemms"):
                coverage += f"; {row['small_gemms']} small GEMM(s) float"
        parity = "-"
        if row.get("rel_l2") is not None:
            parity = f"{row['max_abs_diff']:.2g} ({row['rel_l2']:.1e})" + (
                "" if row["parity_ok"] else " **fail**"
            )
        build = _yes(row["build_ok"])
        if row.get("error"):
            build += f"; **{row['stage']} failed**: {_short(row['error'])}"
        lines.append(
            [
                f"`{row['class']}`",
                ", ".join(f"`{a}`" for a in row.get("attention") or [])
                or "none",
                build,
                _yes(row.get("qat_ok")),
                _yes(row.get("round_trip_ok")),
                _yes(row.get("export_ok")),
                coverage,
                _modelopt_text(row),
                _lint_text(row),
                parity,
                _fmt(row.get("seconds"), ".0f"),
            ]
        )
    return markdown_table(header, lines)


def _left_float(rows):
    lines = []
    for row in rows:
        left = row.get("left_float")
        if left:
            shown = ", ".join(f"`{n}`" for n in left[:6])
            more = f" and {len(left) - 6} more" if len(left) > 6 else ""
            lines.append(f"- `{row['class']}`: {shown}{more}")
    return "\n".join(lines) or "none"


def summary(rows):
    built = [r for r in rows if not r.get("skipped")]
    exported = [r for r in built if r.get("weighted_ops")]
    goal = [r for r in exported if r["coverage"] >= COVERAGE_GOAL]
    by_rule = [
        r
        for r in exported
        if r.get("coverage_by_rule", r["coverage"]) >= COVERAGE_GOAL
    ]
    parity = [r for r in exported if r.get("parity_ok")]
    failed = [r for r in built if r.get("error")]
    return {
        "classes": len(rows),
        "skipped": len(rows) - len(built),
        "built": sum(bool(r.get("build_ok")) for r in built),
        "qat_ok": sum(bool(r.get("qat_ok")) for r in built),
        "round_trip_ok": sum(bool(r.get("round_trip_ok")) for r in built),
        "exported": len(exported),
        "coverage_goal_met": len(goal),
        "coverage_goal_met_by_rule": len(by_rule),
        "parity_ok": len(parity),
        "failed": [f"{r['class']} ({r['stage']})" for r in failed],
        "below_goal": [
            f"{r['class']} {100 * r['coverage']:.0f}%"
            for r in exported
            if r["coverage"] < COVERAGE_GOAL
        ],
    }


def markdown(rows, totals, modelopt):
    intro = (
        "One row per `keras_hub.models.*Backbone` class of keras-hub "
        f"{hub_models.keras_hub().__version__} "
        f"({totals['classes']} classes; {totals['skipped']} not built, with "
        "the reason): a tiny random-weight backbone from a config "
        "(`benchmarks/hub_models.py`: 2 layers, hidden 32, 2 heads, "
        "vocabulary 100, 16 tokens, 32x32 images where the architecture "
        "allows), `quantize_model` -> `calibrate` (max, 32 random inputs of "
        "its own format) -> one QAT step (Adam on the mean square of its "
        "float outputs: ok when the loss is finite and weights moved) -> "
        "`.keras` round trip with `safe_mode=True` (ok: bit-identical "
        "outputs) -> `export_onnx` INT8 -> `check_tensorrt` -> ONNX Runtime "
        "parity on 8 other inputs (graph optimizations off; pass at "
        f"relative L2 <= {MAX_REL_L2:g}). Behind Q/DQ: Conv, "
        "ConvTranspose, MatMul and Gemm nodes with a DequantizeLinear on "
        f"both inputs, attention matmuls included (goal >= "
        f"{100 * COVERAGE_GOAL:.0f}%). ModelOpt: its ONNX PTQ (int8, max "
        "calibration on the same 32 inputs) of the float ONNX keras_mp "
        "exported, counted by the same lint. Seconds: the whole row on 2 "
        "shared CPU cores."
    )
    lines = [
        intro,
        "",
        f"Built {totals['built']}/{totals['classes'] - totals['skipped']}; "
        f"QAT step {totals['qat_ok']}; `.keras` round trip "
        f"{totals['round_trip_ok']}; exported {totals['exported']}; "
        f"coverage >= {100 * COVERAGE_GOAL:.0f}% on "
        f"{totals['coverage_goal_met']}/{totals['exported']} (on "
        f"{totals['coverage_goal_met_by_rule']}/{totals['exported']} when "
        "the MatMuls the small-GEMM rule keeps float, K or N below 16, are "
        "not counted); ONNX Runtime "
        f"parity {totals['parity_ok']}/{totals['exported']}. "
        f"ModelOpt: {modelopt}.",
        "",
        table(rows),
        "",
        "Weighted ops left float (first six per class; why: "
        "`docs/keras_hub.md`):",
        "",
        _left_float(rows),
    ]
    return "\n".join(lines)


def main():
    parser = bench_parser(__doc__, "smoke run: " + ", ".join(QUICK))
    add_only(parser)
    add_modelopt(parser, MODELOPT_VENV)
    parser.add_argument(
        "--modelopt-only",
        action="store_true",
        help="the ModelOpt pass alone, merged into the rows of the last "
        "results (implies --merge)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="replace the rows measured in the last results, keep the rest "
        "(several runs with `--merge --only` may share the file)",
    )
    args = parser.parse_args()
    hub_models.keras_hub()
    known = sorted({*hub_models.BACKBONES, *hub_models.SKIPPED})
    names = args.only or (QUICK if args.quick else known)
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown class(es) {unknown}; known: {known}")
    args.merge = args.merge or args.modelopt_only
    venv, modelopt = modelopt_venv(args)
    if modelopt.startswith("not run"):
        venv = None  # no ModelOpt column for the rows
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for name in names:
            if name in hub_models.SKIPPED:
                rows.append(_skipped(name, hub_models.SKIPPED[name]))
                continue
            print(f"[bench_hub] {name}", flush=True)
            if args.modelopt_only:
                rows.append(measure_modelopt_only(name, directory, venv))
            else:
                rows.append(measure(name, directory, venv))
            if venv is not None:
                rows[-1]["modelopt_versions"] = modelopt
            print(f"[bench_hub]   {rows[-1]}", flush=True)
            keras.backend.clear_session()
            for f in os.listdir(directory):
                os.remove(os.path.join(directory, f))
            # after every row: a long run leaves its results so far
            _write(rows, modelopt, args.merge, args.quick)
    _write(rows, modelopt, args.merge, args.quick)


def _merged(last, rows):
    """`last`'s rows with `rows` in place of those of the same class (a
    ModelOpt-only row updates its class's row instead; a row measured with
    `--no-modelopt` keeps the ModelOpt figures of the row it replaces:
    ModelOpt quantizes keras_mp's float export, which keras_mp's
    quantization does not change)."""
    mine = {r["class"]: r for r in rows}
    merged = []
    for row in last:
        new = mine.pop(row["class"], row)
        if new.get("modelopt_only"):
            new = {**row, **new}
        elif new is not row and not any(k.startswith("modelopt") for k in new):
            kept = {k: v for k, v in row.items() if k.startswith("modelopt")}
            new = {**new, **kept}
        merged.append(new)
    merged += list(mine.values())
    return sorted(merged, key=lambda r: r["class"].lower())


def _write(rows, modelopt, merge, quick):
    """Writes results/hub.* (`hub_quick.*` when `quick`); with `merge`,
    the rows of the file as it is now (another run may be writing it too)
    beside these, and the commands that measured them."""
    commands = [command_line()]
    path = os.path.join(RESULTS, "hub.json")
    if merge and os.path.exists(path):
        with open(path) as f:
            last = json.load(f)
        rows = _merged(last["rows"], rows)
        before = last.get("commands") or [last["command"]]
        commands = list(dict.fromkeys(before + commands))
    versions = {
        r["modelopt_versions"] for r in rows if "modelopt_versions" in r
    }
    if versions:
        ran = sum("modelopt_qdq_nodes" in r for r in rows)
        modelopt = f"{', '.join(sorted(versions))}; run on {ran} classes"
    totals = summary(rows)
    text = markdown(rows, totals, modelopt)
    if len(commands) > 1:
        shown = ", ".join(f"`{c}`" for c in commands)
        text = f"Rows measured by {shown}.\n\n{text}"
    write_results(
        "hub",
        {
            "rows": rows,
            "summary": totals,
            "modelopt": modelopt,
            "commands": commands,
        },
        text,
        quick=quick,
    )
    if not quick:
        render_doc(rows)


if __name__ == "__main__":
    main()

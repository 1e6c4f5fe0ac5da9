"""Peer benchmark, last step (main venv): every peer's ONNX judged the same way.

For each ONNX file named in `--candidates` (JSON: label -> file name in
the work folder):

- test top-1 on the 10,000 test images (`--test-images`) in ONNX Runtime
  with graph optimizations disabled (Q/DQ reference semantics: ORT's fused CPU
  integer kernels saturate on CPUs without VNNI, docs/export.md), and with
  ORT's default optimizations beside it;
- `keras_mp.check_tensorrt`: pass/fail, first violations, Q/DQ node count,
  weighted ops and how many have both inputs quantized, QOperator ops;
- ONNX Runtime CPU latency at batch 1 and 64 (default optimizations,
  `--threads` intra-op threads), every model timed side by side in
  interleaved rounds (the order rotates each round), median per round of
  `--repeats-b1` / `--repeats-b64` runs, median over rounds; the ratio is
  model latency / float32 latency (above 1: slower than float32).

Writes `eval.json` in the work folder.
"""

import argparse
import collections
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from _peer_common import load_data, write_json  # noqa: E402

import keras_mp  # noqa: E402

QOPERATOR_OPS = (
    "QLinearConv",
    "QLinearMatMul",
    "ConvInteger",
    "MatMulInteger",
    "DynamicQuantizeLinear",
)


def session(path, optimized, threads=None, save_optimized=None):
    options = ort.SessionOptions()
    if save_optimized:
        options.optimized_model_filepath = save_optimized
    if not optimized:
        options.graph_optimization_level = (
            ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        )
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    return ort.InferenceSession(
        path, options, providers=["CPUExecutionProvider"]
    )


def top1(sess, x, y, batch=500):
    name = sess.get_inputs()[0].name
    logits = np.concatenate(
        [
            sess.run(None, {name: x[i : i + batch]})[0]
            for i in range(0, len(x), batch)
        ]
    )
    return round(100 * float(np.mean(logits.argmax(-1) == y)), 2)


def lint(path):
    report = keras_mp.check_tensorrt(path)
    ops = collections.Counter(n.op_type for n in onnx.load(path).graph.node)
    return {
        "ok": report.ok,
        "violations": len(report.violations),
        "warnings": len(report.warnings),
        "violation_rules": dict(
            collections.Counter(f.rule for f in report.violations)
        ),
        "warning_rules": dict(
            collections.Counter(f.rule for f in report.warnings)
        ),
        "first_violations": [str(f) for f in report.violations[:3]],
        "num_qdq": report.num_qdq,
        "weighted_ops": report.weighted_ops,
        "weighted_ops_quantized": report.weighted_ops_quantized,
        "qoperator_ops": {k: ops[k] for k in QOPERATOR_OPS if ops[k]},
    }


def latency(paths, x, threads, rounds, repeats_b1, repeats_b64):
    """Median ms per run at batch 1 and 64, all models interleaved."""
    sessions = {k: session(p, True, threads) for k, p in paths.items()}
    names = {k: s.get_inputs()[0].name for k, s in sessions.items()}
    batches = {1: (x[:1], repeats_b1), 64: (x[:64], repeats_b64)}
    for k, s in sessions.items():  # warm-up
        for xb, _ in batches.values():
            for _ in range(5):
                s.run(None, {names[k]: xb})
    times = {b: {k: [] for k in sessions} for b in batches}
    labels = list(sessions)
    for r in range(rounds):
        shift = r % len(labels)
        order = labels[shift:] + labels[:shift]
        if r % 2:
            order = order[::-1]
        for k in order:
            for b, (xb, repeats) in batches.items():
                t = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    sessions[k].run(None, {names[k]: xb})
                    t.append(time.perf_counter() - start)
                times[b][k].append(float(np.median(t)))
    return {
        k: {
            f"ms_batch{b}": round(1000 * float(np.median(times[b][k])), 4)
            for b in batches
        }
        for k in labels
    }


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workdir", required=True)
    p.add_argument("--candidates", required=True)
    p.add_argument("--test-images", type=int, default=10000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--repeats-b1", type=int, default=200)
    p.add_argument("--repeats-b64", type=int, default=20)
    a = p.parse_args()
    w = a.workdir
    d = load_data(w)
    xt, yt = d["x_test"][: a.test_images], d["y_test"][: a.test_images]
    with open(a.candidates) as f:
        candidates = json.load(f)
    out, paths = {}, {}
    for label, filename in candidates.items():
        path = os.path.join(w, filename)
        entry = {"onnx": filename}
        try:
            entry["ort_top1_reference"] = top1(session(path, False), xt, yt)
            saved = os.path.join(w, "ort_optimized_" + filename)
            entry["ort_top1_optimized"] = top1(
                session(path, True, save_optimized=saved), xt, yt
            )
            ops = collections.Counter(
                n.op_type for n in onnx.load(saved).graph.node
            )
            # What ORT's CPU optimizer turned the graph into: its integer
            # kernels (QLinearConv, QGemm, ...) are where the default-
            # optimized accuracy can drop (saturation without VNNI).
            entry["ort_integer_kernels"] = {
                k: v
                for k, v in sorted(ops.items())
                if k.startswith(("QLinear", "QGemm")) or k in QOPERATOR_OPS
            }
            paths[label] = path
        except Exception as e:
            entry["ort_error"] = f"{type(e).__name__}: {str(e)[:800]}"
        try:
            entry["lint"] = lint(path)
        except Exception as e:
            entry["lint_error"] = f"{type(e).__name__}: {str(e)[:800]}"
        out[label] = entry
        print(label, {k: v for k, v in entry.items() if k != "lint"})
    lat = latency(
        paths, d["x_val"], a.threads, a.rounds, a.repeats_b1, a.repeats_b64
    )
    base = lat.get("float32")
    for label, ms in lat.items():
        out[label]["latency"] = ms
        if base:
            for b in (1, 64):
                key = f"ms_batch{b}"
                ms[f"ratio_batch{b}"] = round(ms[key] / base[key], 3)
    out["_latency_method"] = (
        f"ORT default optimizations, intra_op_num_threads={a.threads}, "
        f"{a.rounds} interleaved rounds (order rotated), median of "
        f"{a.repeats_b1} runs (batch 1) / {a.repeats_b64} runs (batch 64) "
        "per round, median over rounds; ratio = model / float32"
    )
    out["_test_images"] = len(xt)
    write_json(w, "eval", out)


if __name__ == "__main__":
    main()

"""keras_mp against the quantization tools people use today, side by side.

One float32 Keras model (`reference_cnn`, Fashion-MNIST) is trained once and
saved (`.keras`, its float ONNX, its weights as `.npz`); every peer starts
from it, on the same split, each in its own process:

1. keras_mp PTQ (best of max / percentile / entropy / mse / auto, chosen on a
   validation slice of the training set) and keras_mp QAT (1 epoch, Adam,
   cosine decay from 1e-4), with a float32 control fine-tuned the same way.
2. ONNX Runtime `quantize_static` on the float ONNX: QDQ, QInt8 weights and
   activations, per-channel, symmetric; MinMax, Entropy, Percentile (plus
   MinMax with `QuantizeBias=False`, to see if ORT can be TensorRT-clean).
3. NVIDIA ModelOpt ONNX PTQ (`python -m modelopt.onnx.quantization`,
   int8, entropy and max calibration) in its own venv.
4. tfmot QAT on a tf_keras twin (own venv: importing tfmot switches the
   process to legacy Keras), same weights, same fine-tune, exported with
   tf2onnx.
5. Keras 3 `model.quantize("int8")` on a copy, exported with Keras'
   `model.export(format="onnx")` (and `keras_mp.export_onnx`).

Then every ONNX is judged the same way (`peers/evaluate.py`): test top-1
in ONNX Runtime with graph optimizations disabled (Q/DQ semantics) and
with the defaults beside it, `keras_mp.check_tensorrt`, Q/DQ count and
weighted-op coverage, ORT CPU latency / float32 at batch 1 and 64
(interleaved), and for the QAT tools the train-step time / their own
float32 twin. A peer that fails is a result: its error is recorded.

One fine-tune is within the seed-to-seed spread of a QAT-vs-control gap,
so each QAT tool and its control are fine-tuned `--qat-seeds` times, on
fine-tune orders 0..N-1 (order 0 the shared fixed order, order k that
order permuted with seed k; both tools see the same batches per order).
The order-0 models are the ones exported and step-timed. The QAT goal is
judged on keras_mp QAT's mean Keras top-1 over the orders against every PTQ
peer's ONNX top-1 and tfmot QAT's mean over the same orders; the order-0
ONNX comparison is kept beside it for reference.

    python benchmarks/bench_peers.py [--setup] [--quick] [--qat-seeds N]

`--setup` creates the two side environments when missing
(`benchmarks/.venv-modelopt`, `benchmarks/.venv-tfmot`, gitignored).
The full run writes `benchmarks/results/peers.{json,md,png}`; `--quick`
(a small subset, about 5-10 minutes on a busy 2-core machine) writes its
results into the work folder only, so it never replaces the full run's.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = os.path.join(HERE, "peers")
sys.path.insert(0, HERE)

sys.path.insert(0, PEERS)

import render  # noqa: E402
from _common import RESULTS, bench_parser, command_line, versions  # noqa: E402
from _peer_common import mean_and_sd, positive_int  # noqa: E402

DOCS_PAGE = os.path.join(os.path.dirname(HERE), "docs", "benchmarks.md")

MAIN_PYTHON = sys.executable
SETUP = {
    "modelopt": [
        ["pip", "install", "--upgrade", "pip"],
        # The local CPU build first, or pip pulls a multi-GB CUDA torch.
        ["pip", "install", "torch==2.13.0"],
        ["pip", "install", "nvidia-modelopt[onnx]"],
    ],
    "tfmot": [
        ["pip", "install", "--upgrade", "pip"],
        [
            "pip",
            "install",
            "tensorflow-cpu==2.21.0",
            "tf-keras==2.21.0",
            "tensorflow-model-optimization==0.8.1",
            "tf2onnx==1.17.0",
            "onnx",
            "onnxruntime==1.32.0",
        ],
    ],
}


def log(msg):
    print(f"[bench_peers {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def setup_venv(path, steps):
    if os.path.exists(os.path.join(path, "bin", "python")):
        log(f"{path} exists; not reinstalling")
        return
    log(f"creating {path}")
    subprocess.run([sys.executable, "-m", "venv", path], check=True)
    for step in steps:
        cmd = [os.path.join(path, "bin", "python"), "-m"] + step
        log("  " + " ".join(step))
        subprocess.run(cmd, check=True)


def _children_cpu():
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_step(name, cmd, workdir, timeout):
    """Runs one helper in its own process; its output goes to <name>.log."""
    log_path = os.path.join(workdir, f"{name}.log")
    shown = " ".join(os.path.relpath(c) if os.sep in c else c for c in cmd)
    log(f"{name}: {shown}")
    start = time.perf_counter()
    cpu_start = _children_cpu()
    env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2")
    with open(log_path, "w") as f:
        try:
            rc = subprocess.run(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                env=env,
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        except OSError as e:  # e.g. the venv's python is missing
            f.write(f"{type(e).__name__}: {e}\n")
            rc = "oserror"
    seconds = round(time.perf_counter() - start, 1)
    status = {
        "returncode": rc,
        "seconds": seconds,
        # CPU time of the helper (all threads): on a shared machine, wall
        # time far above it / cores means the helper waited for a core.
        "cpu_seconds": round(_children_cpu() - cpu_start, 1),
        "log": f"{name}.log",
    }
    if rc != 0:
        with open(log_path) as f:
            lines = [
                ln.rstrip()
                for ln in f
                if ln.strip() and "Warning" not in ln and "warn(" not in ln
            ]
        status["error"] = "\n".join(lines[-12:])
        log(f"{name} FAILED ({rc}) after {seconds} s:\n{status['error']}")
    else:
        log(f"{name} done in {seconds} s")
    return status


def read(workdir, name):
    path = os.path.join(workdir, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def main():
    p = bench_parser(
        __doc__, "a small subset, its results in the work folder only"
    )
    p.add_argument("--setup", action="store_true")
    p.add_argument(
        "--render",
        action="store_true",
        help="only redraw peers.md, peers.png and docs/benchmarks.md from "
        "benchmarks/results/peers.json, its goals recomputed from the stored "
        "rows (no run)",
    )
    p.add_argument(
        "--workdir",
        default=os.path.join(tempfile.gettempdir(), "keras_mp_peers"),
        help="models, ONNX files and logs (default: %(default)s)",
    )
    p.add_argument(
        "--modelopt-venv", default=os.path.join(HERE, ".venv-modelopt")
    )
    p.add_argument("--tfmot-venv", default=os.path.join(HERE, ".venv-tfmot"))
    p.add_argument(
        "--rerun",
        nargs="+",
        choices=TOOLS,
        help="run these tools' steps again (then evaluate) in the workdir "
        "of the last full run, keeping its float model and the other "
        "tools' outputs; the results say which steps were rerun",
    )
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--qat-seeds",
        type=positive_int,
        default=None,
        help="fine-tune orders (and seeds) per QAT tool and its control "
        "(default 3; 2 with --quick, so the loop is exercised)",
    )
    p.add_argument("--step-timeout", type=float, default=3600)
    a = p.parse_args()
    if a.qat_seeds is None:
        a.qat_seeds = 2 if a.quick else 3
    if a.render:
        with open(os.path.join(RESULTS, "peers.json")) as f:
            results = json.load(f)
        # The goals again, by this version's rules, from the stored rows.
        results["goals"] = goals(
            results["rows"], results["keras_mp"], results["tfmot"]
        )
        print(render.write_outputs(results, RESULTS, DOCS_PAGE))
        return
    wall = time.perf_counter()
    if a.rerun:
        return rerun(a, wall)
    if a.setup:
        setup_venv(a.modelopt_venv, SETUP["modelopt"])
        setup_venv(a.tfmot_venv, SETUP["tfmot"])
    w = a.workdir
    os.makedirs(w, exist_ok=True)
    for f in os.listdir(w):  # a stale result must never pass for a new one
        if f.endswith((".json", ".onnx", ".log", ".npz", ".keras")):
            os.remove(os.path.join(w, f))

    size = (
        [
            "--train-images",
            "4096",
            "--val-images",
            "1000",
            "--calib-images",
            "512",
            "--epochs",
            "1",
        ]
        if a.quick
        else ["--epochs", str(a.epochs)]
    )
    timing = (
        ["--timing-rounds", "2", "--timing-repeats", "3"] if a.quick else []
    )
    finetune = ["--seed", str(a.seed), "--qat-seeds", str(a.qat_seeds)]
    py = os.path.join(PEERS, "{}.py")
    steps = {}
    wd = ["--workdir", w]
    steps["train_float"] = run_step(
        "train_float",
        [MAIN_PYTHON, py.format("train_float")]
        + wd
        + size
        + ["--width", str(a.width), "--seed", str(a.seed)],
        w,
        a.step_timeout,
    )
    if steps["train_float"]["returncode"] == 0:
        for name, python, extra in tool_plan(a, timing + finetune):
            steps[name] = run_step(
                name,
                [python, py.format(f"{name}_peer")] + wd + extra,
                w,
                a.step_timeout,
            )
        steps["evaluate"] = evaluate_step(a, w)
    results = assemble(a, w, steps)
    results["total_seconds"] = round(time.perf_counter() - wall, 1)
    results["total_cpu_seconds"] = round(_children_cpu(), 1)
    results["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    write_all(a, w, results)


def collect_candidates(w):
    """label -> ONNX file, for every ONNX a peer managed to write."""
    c = {"float32": "float.onnx"}
    if os.path.exists(os.path.join(w, "keras_mp_ptq.onnx")):
        c["keras_mp PTQ"] = "keras_mp_ptq.onnx"
    if os.path.exists(os.path.join(w, "keras_mp_qat.onnx")):
        c["keras_mp QAT"] = "keras_mp_qat.onnx"
    for m in ("minmax", "entropy", "percentile", "minmax_nobias"):
        if os.path.exists(os.path.join(w, f"ort_{m}.onnx")):
            c[f"ORT {m}"] = f"ort_{m}.onnx"
    for m in ("entropy", "max"):
        if os.path.exists(os.path.join(w, f"modelopt_{m}.onnx")):
            c[f"ModelOpt {m}"] = f"modelopt_{m}.onnx"
    if os.path.exists(os.path.join(w, "tfmot_qat.onnx")):
        c["tfmot QAT"] = "tfmot_qat.onnx"
    if os.path.exists(os.path.join(w, "keras_int8_native.onnx")):
        c["Keras int8"] = "keras_int8_native.onnx"
    return c


def other_versions(a):
    """Versions in the side venvs (pip metadata, no import)."""
    out = {}
    probe = (
        "import importlib.metadata as m, json, sys\n"
        "v = {}\n"
        "for p in sys.argv[1:]:\n"
        "    try: v[p] = m.version(p)\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(v))"
    )
    for venv, pkgs in (
        (
            a.modelopt_venv,
            ["nvidia-modelopt", "torch", "onnx", "onnxruntime-gpu"],
        ),
        (
            a.tfmot_venv,
            [
                "tensorflow",
                "tf-keras",
                "tensorflow-model-optimization",
                "tf2onnx",
                "onnx",
                "onnxruntime",
            ],
        ),
    ):
        python = os.path.join(venv, "bin", "python")
        key = os.path.basename(venv)
        try:
            r = subprocess.run(
                [python, "-c", probe] + pkgs, capture_output=True, text=True
            )
            out[key] = json.loads(r.stdout)
        except (OSError, ValueError) as e:
            out[key] = {"error": f"{type(e).__name__}: {e}"}
    return out


TOOLS = ("keras_mp", "ort", "modelopt", "tfmot", "keras_quantize")


def tool_plan(a, qat_args):
    """`(step, python, extra arguments)` of each tool, in run order."""
    return [
        ("keras_mp", MAIN_PYTHON, qat_args),
        ("ort", MAIN_PYTHON, []),
        ("modelopt", MAIN_PYTHON, ["--venv", a.modelopt_venv]),
        ("tfmot", os.path.join(a.tfmot_venv, "bin", "python"), qat_args),
        ("keras_quantize", MAIN_PYTHON, []),
    ]


def evaluate_step(a, w):
    """Every candidate ONNX on the test images (ONNX Runtime)."""
    py = os.path.join(PEERS, "{}.py")
    candidates = collect_candidates(w)
    cand_path = os.path.join(w, "candidates.json")
    with open(cand_path, "w") as f:
        json.dump(candidates, f, indent=2)
    return run_step(
        "evaluate",
        [MAIN_PYTHON, py.format("evaluate"), "--workdir", w]
        + ["--candidates", cand_path]
        + (
            [
                "--rounds",
                "3",
                "--repeats-b1",
                "50",
                "--repeats-b64",
                "5",
                "--test-images",
                "2000",
            ]
            if a.quick
            else []
        ),
        w,
        a.step_timeout,
    )


def rerun(a, wall):
    """`--rerun`: the named tools' steps again in the last full run's
    workdir, then evaluate and assemble with the other steps as they were
    (the float model is not retrained)."""
    with open(os.path.join(RESULTS, "peers.json")) as f:
        earlier = json.load(f)
    w = a.workdir
    steps = dict(earlier["steps"])
    py = os.path.join(PEERS, "{}.py")
    finetune = ["--seed", str(a.seed), "--qat-seeds", str(a.qat_seeds)]
    for name, python, extra in tool_plan(a, finetune):
        if name in a.rerun:
            steps[name] = run_step(
                name,
                [python, py.format(f"{name}_peer"), "--workdir", w] + extra,
                w,
                a.step_timeout,
            )
    steps["evaluate"] = evaluate_step(a, w)
    results = assemble(a, w, steps)
    results["total_seconds"] = earlier.get("total_seconds")
    results["rerun"] = {
        "steps": list(a.rerun),
        "seconds": round(time.perf_counter() - wall, 1),
        "full_run_command": earlier.get("rerun", {}).get(
            "full_run_command", earlier.get("command")
        ),
    }
    write_all(a, w, results)


def assemble(a, w, steps):
    float_ = read(w, "float") or {}
    kmp = read(w, "keras_mp")
    ort = read(w, "ort")
    mo = read(w, "modelopt")
    tfmot = read(w, "tfmot")
    kq = read(w, "keras_quantize")
    ev = read(w, "eval") or {}

    def failed(step):
        s = steps.get(step)
        if s is None:
            return "not run (float training failed)"
        if s["returncode"] != 0:
            return f"helper exited {s['returncode']}: {s.get('error', '')}"
        return None

    rows = []

    def row(
        label, peer, kind, keras_top1=None, step_ratio=None, error=None, note=""
    ):
        e = ev.get(label, {})
        rows.append(
            {
                "label": label,
                "peer": peer,
                "kind": kind,
                "onnx": e.get("onnx"),
                "test_top1_ort_reference": e.get("ort_top1_reference"),
                "test_top1_ort_optimized": e.get("ort_top1_optimized"),
                "ort_integer_kernels": e.get("ort_integer_kernels"),
                "test_top1_keras": keras_top1,
                "lint": e.get("lint"),
                "latency": e.get("latency"),
                "train_step_ratio": (
                    step_ratio.get("ratio")
                    if isinstance(step_ratio, dict)
                    else step_ratio
                ),
                "train_step_cpu_ratio": (
                    step_ratio.get("cpu_ratio")
                    if isinstance(step_ratio, dict)
                    else None
                ),
                "error": error or e.get("ort_error") or e.get("lint_error"),
                "note": note,
            }
        )

    row(
        "float32",
        "float32",
        "reference",
        float_.get("keras_test_top1"),
        error=failed("train_float"),
    )
    if kmp:
        best = kmp["best_ptq_method"]
        row(
            "float32 control",
            "keras_mp",
            "float32 +1 epoch",
            kmp["control"]["keras_test_top1"],
            1.0,
            note="float model fine-tuned like QAT (Keras 3)",
        )
        row(
            "keras_mp PTQ",
            "keras_mp",
            "PTQ",
            kmp["ptq"][best]["keras_test_top1"],
            note=f"best calibrator on validation: {best}",
        )
        row(
            "keras_mp QAT",
            "keras_mp",
            "QAT",
            kmp["qat"]["keras_test_top1"],
            kmp["step_time"],
            note=f"from {kmp['qat']['start']} calibration",
        )
    else:
        row("keras_mp PTQ", "keras_mp", "PTQ", error=failed("keras_mp"))
        row("keras_mp QAT", "keras_mp", "QAT", error=failed("keras_mp"))
    if ort:
        for m, entry in ort["methods"].items():
            label = f"ORT {m.lower()}"
            row(
                label,
                "ONNX Runtime",
                "PTQ",
                error=entry.get("error"),
                note=entry.get("note", ""),
            )
    else:
        row("ORT", "ONNX Runtime", "PTQ", error=failed("ort"))
    if mo and "methods" in mo:
        for m, entry in mo["methods"].items():
            row(f"ModelOpt {m}", "ModelOpt", "PTQ", error=entry.get("error"))
    else:
        row(
            "ModelOpt",
            "ModelOpt",
            "PTQ",
            error=(mo or {}).get("error") or failed("modelopt"),
        )
    if tfmot:
        row(
            "tfmot float32 control",
            "tfmot",
            "float32 +1 epoch",
            tfmot["control"]["keras_test_top1"],
            1.0,
            note="tf_keras twin fine-tuned like QAT (no ONNX)",
        )
        row(
            "tfmot QAT",
            "tfmot",
            "QAT",
            tfmot["qat"]["keras_test_top1"],
            tfmot["step_time"],
            error=None if tfmot["export"]["ok"] else tfmot["export"]["error"],
            note=f"tf_keras twin with the copied float weights: "
            f"{tfmot['float_twin_test_top1']:.2f} (Keras 3 model: "
            f"{float_.get('keras_test_top1', float('nan')):.2f}); tfmot QAT "
            f"model before its fine-tune: "
            f"{tfmot['qat_before_finetune_test_top1']:.2f} (ranges start "
            f"uncalibrated); exported with {tfmot['export'].get('how')}",
        )
    else:
        row("tfmot QAT", "tfmot", "QAT", error=failed("tfmot"))
    if kq and kq.get("quantize", {}).get("ok"):
        exports = kq.get("exports", {})
        native = exports.get('model.export(format="onnx")', {})
        left = kq["quantize"]["layers_left_float"]
        row(
            "Keras int8",
            "Keras quantize",
            "PTQ",
            kq["keras_test_top1"],
            error=None if native.get("ok") else native.get("error"),
            note=f"quantized {', '.join(kq['quantize']['layers_quantized'])};"
            f" left float: {', '.join(left)}",
        )
        via = exports.get("keras_mp.export_onnx", {})
        if via.get("ok"):
            rows[-1]["note"] += (
                "; keras_mp.export_onnx of the same model: TensorRT lint "
                + ("PASS" if via["tensorrt_lint_ok"] else "FAIL")
                + f", {via['num_qdq']} Q/DQ nodes"
            )
        elif via:
            rows[-1]["note"] += (
                f"; keras_mp.export_onnx of the same model failed: "
                f"{via.get('error')}"
            )
    else:
        row(
            "Keras int8",
            "Keras quantize",
            "PTQ",
            error=((kq or {}).get("quantize") or {}).get("error")
            or failed("keras_quantize"),
        )

    results = {
        "config": {
            "quick": a.quick,
            "width": a.width,
            "float_epochs": float_.get("epochs"),
            "train_images": float_.get("train_images"),
            "val_images": float_.get("val_images"),
            "calib_images": float_.get("calib_images"),
            "test_images": ev.get("_test_images"),
            "seed": a.seed,
            "qat_seeds": a.qat_seeds,
            "finetune": (kmp or {}).get("qat", {}).get("optimizer"),
            "latency_method": ev.get("_latency_method"),
            "workdir": w,
        },
        "float32": float_,
        "rows": rows,
        "keras_mp": kmp,
        "onnxruntime": ort,
        "modelopt": mo,
        "tfmot": tfmot,
        "keras_quantize": kq,
        "steps": steps,
        "side_venvs": other_versions(a),
    }
    results["goals"] = goals(rows, kmp, tfmot)
    results["calibrators"] = calibrator_table(rows, kmp)
    return results


def _by(rows, label):
    return next((r for r in rows if r["label"] == label), None)


def _per_order(peer, name):
    """A QAT tool's `name` ("qat" or "control") Keras test top-1 per
    fine-tune order ([] when the tool failed)."""
    return [r[f"{name}_keras_test_top1"] for r in (peer or {}).get("runs", [])]


def qat_mean_goal(rows, kmp, tfmot):
    """The verdict: keras_mp QAT's mean Keras top-1 over the fine-tune orders
    against every PTQ peer's ONNX top-1 and tfmot QAT's mean over the same
    orders (one fine-tune per tool is within the seed-to-seed spread)."""
    ours, theirs = _per_order(kmp, "qat"), _per_order(tfmot, "qat")
    ptq = {
        r["label"]: r["test_top1_ort_reference"]
        for r in rows
        if r["kind"] == "PTQ"
        and r["peer"] != "keras_mp"
        and r["test_top1_ort_reference"] is not None
    }
    tf_mean, tf_sd = mean_and_sd(theirs) if theirs else (None, None)
    peers = dict(ptq)
    if theirs:
        peers["tfmot QAT"] = tf_mean
    if not ours or not peers:
        # A goal that could not be measured fails; it never disappears.
        missing = "keras_mp QAT" if not ours else "every peer"
        return {"pass": False, "reason": f"not measured: {missing} failed"}
    mean, sd = mean_and_sd(ours)
    best = max(peers, key=peers.get)
    qat = _by(rows, "keras_mp QAT")
    return {
        "orders": len(ours),
        "keras_mp_qat_mean": mean,
        "keras_mp_qat_sd": sd,
        "keras_mp_qat_per_order": ours,
        "tfmot_qat_mean": tf_mean,
        "tfmot_qat_sd": tf_sd,
        "tfmot_qat_per_order": theirs,
        "ptq_peers_top1_ort": ptq,
        "best_peer": best,
        "best_peer_top1": peers[best],
        "keras_mp_qat_parity": kmp["qat_parity"],
        # The order-0 model in Keras and in ONNX Runtime (no opt.), same
        # test images: how far the Keras figures stand in for ONNX ones.
        "keras_mp_qat_keras_minus_onnx_order0_points": (
            None
            if qat is None or qat["test_top1_ort_reference"] is None
            else round(
                qat["test_top1_keras"] - qat["test_top1_ort_reference"], 2
            )
        ),
        "how": "keras_mp QAT's mean Keras test top-1 over the fine-tune "
        "orders vs every PTQ peer's ONNX top-1 (ORT, no opt.) and tfmot "
        "QAT's mean tf_keras test top-1 over the same orders. The QAT tools "
        "are compared by their own framework's evaluation because only the "
        "order-0 models are exported and tfmot's float32 control has no "
        "ONNX; keras_mp's Keras and ONNX top-1 agree, by the ONNX Runtime "
        "parity of its order-0 QAT export measured in this run "
        "(keras_mp_qat_parity).",
        "pass": mean >= peers[best],
    }


def qat_onnx_order0_goal(rows):
    """For reference: the order-0 keras_mp QAT ONNX against every peer's
    ONNX, one fine-tune per QAT tool (the verdict before several orders)."""
    qat = _by(rows, "keras_mp QAT")
    qat_top1 = qat and qat["test_top1_ort_reference"]
    peers = [
        r
        for r in rows
        if r["peer"] not in ("keras_mp", "float32")
        and r["test_top1_ort_reference"] is not None
    ]
    if qat_top1 is None or not peers:
        missing = "keras_mp QAT ONNX" if qat_top1 is None else "every peer"
        return {"pass": False, "reason": f"not measured: {missing} failed"}
    best_peer = max(peers, key=lambda r: r["test_top1_ort_reference"])
    return {
        "keras_mp_qat": qat_top1,
        "best_peer": best_peer["label"],
        "best_peer_top1": best_peer["test_top1_ort_reference"],
        "pass": qat_top1 >= best_peer["test_top1_ort_reference"],
    }


def control_gap(peer):
    """QAT - its float32 control (Keras top-1 points) per fine-tune order,
    and their mean and sd."""
    gaps = [
        round(q - c, 2)
        for q, c in zip(_per_order(peer, "qat"), _per_order(peer, "control"))
    ]
    if not gaps:
        return None
    mean, sd = mean_and_sd(gaps)
    return {
        "orders": len(gaps),
        "mean_points": mean,
        "sd_points": sd,
        "per_order_points": gaps,
    }


def goals(rows, kmp, tfmot):
    """Issue 7's goals, as measured (pass or fail, never adjusted)."""
    measured = {
        "keras_mp_qat_top1_at_least_every_peer": qat_mean_goal(
            rows, kmp, tfmot
        ),
        "keras_mp_qat_onnx_top1_vs_every_peer_onnx_order0": (
            qat_onnx_order0_goal(rows)
        ),
        "keras_mp_qat_vs_its_float32_control_points": control_gap(kmp),
        "tfmot_qat_vs_its_float32_control_points": control_gap(tfmot),
    }
    out = {k: v for k, v in measured.items() if v is not None}
    kmp_lints = {
        r["label"]: r["lint"]["ok"]
        for r in rows
        if r["peer"] == "keras_mp"
        and r["kind"] != "float32 +1 epoch"
        and r["lint"]
    }
    others = {
        r["label"]: r["lint"]["ok"]
        for r in rows
        if r["label"] in ("tfmot QAT", "Keras int8") and r["lint"]
    }
    out["every_keras_mp_onnx_lint_clean"] = {
        "measured": kmp_lints,
        "pass": bool(kmp_lints) and all(kmp_lints.values()),
    }
    out["tfmot_and_keras_onnx_not_lint_clean"] = {
        "measured": others,
        "pass": bool(others) and not any(others.values()),
    }
    out.update(calibrator_goals(rows, kmp))
    mo = [r for r in rows if r["peer"] == "ModelOpt" and r["lint"]]
    kq = [
        r
        for r in rows
        if r["label"] in ("keras_mp PTQ", "keras_mp QAT") and r["lint"]
    ]
    if mo and kq:
        mo_qdq = min(r["lint"]["num_qdq"] for r in mo)
        covered = all(
            r["lint"]["weighted_ops_quantized"] == r["lint"]["weighted_ops"]
            for r in kq
        )
        most = max(r["lint"]["num_qdq"] for r in kq)
        out[
            "keras_mp_covers_every_weighted_op_with_no_more_qdq_than_modelopt"
        ] = {
            "keras_mp_qdq": most,
            "modelopt_qdq": mo_qdq,
            "keras_mp_weighted_covered": [
                f"{r['lint']['weighted_ops_quantized']}/"
                f"{r['lint']['weighted_ops']}"
                for r in kq
            ],
            "modelopt_weighted_covered": [
                f"{r['lint']['weighted_ops_quantized']}/"
                f"{r['lint']['weighted_ops']}"
                for r in mo
            ],
            "pass": covered and most <= mo_qdq,
        }
    return out


def calibrator_table(rows, kmp):
    """Test top-1 of every PTQ calibrator: keras_mp's in Keras (its ONNX
    matches, by the PTQ export's parity), ModelOpt's and ORT's in ONNX
    Runtime without optimizations; the float32 model's beside them."""
    table = {}
    ref = _by(rows, "float32")
    if ref and ref["test_top1_ort_reference"] is not None:
        table["float32"] = ref["test_top1_ort_reference"]
    for method, r in ((kmp or {}).get("ptq") or {}).items():
        table[f"keras_mp {method}"] = r["keras_test_top1"]
    for r in rows:
        if r["kind"] == "PTQ" and r["peer"] in ("ModelOpt", "ONNX Runtime"):
            if r["test_top1_ort_reference"] is not None:
                table[r["label"]] = r["test_top1_ort_reference"]
    return table


def calibrator_goals(rows, kmp):
    """Issue 25's calibrator goals: every keras_mp calibrator within 0.3
    point of float32, and keras_mp's best PTQ (chosen on validation) at or
    above ModelOpt's best on the same float model and images."""
    table = calibrator_table(rows, kmp)
    ours = {k: v for k, v in table.items() if k.startswith("keras_mp ")}
    theirs = {k: v for k, v in table.items() if k.startswith("ModelOpt ")}
    out = {}
    if "float32" in table and ours:
        gaps = {k: round(v - table["float32"], 2) for k, v in ours.items()}
        out["every_keras_mp_calibrator_within_0.3_point_of_float32"] = {
            "measured": gaps,
            "pass": all(g >= -0.3 for g in gaps.values()),
        }
    best = (kmp or {}).get("best_ptq_method")
    if best and theirs:
        top = max(theirs, key=theirs.get)
        out["keras_mp_best_ptq_at_least_modelopt_best"] = {
            "keras_mp": f"{best} {ours[f'keras_mp {best}']:.2f}",
            "modelopt": f"{top} {theirs[top]:.2f}",
            "pass": ours[f"keras_mp {best}"] >= theirs[top],
        }
    return out


def write_all(a, w, results):
    results["command"] = command_line()
    results["versions"] = versions()
    out_dir = w if a.quick else RESULTS
    docs = None if a.quick else DOCS_PAGE
    print(render.write_outputs(results, out_dir, docs))
    log(f"results in {out_dir}/peers.{{json,md,png}}; models and logs in {w}")


if __name__ == "__main__":
    main()

"""Peer benchmark: NVIDIA ModelOpt ONNX PTQ, through its own command line.

ModelOpt pulls PyTorch, so it lives in its own venv
(`benchmarks/.venv-modelopt`: `pip install torch==2.13.0` first, for the
local CPU build, then `pip install "nvidia-modelopt[onnx]"`). This helper
runs under any Python with NumPy: it writes the shared calibration images
as `calib_modelopt.npz` (keyed by the ONNX input name) and runs, per
calibration method,

    <venv>/bin/python -m modelopt.onnx.quantization --onnx_path=float.onnx
        --quantize_mode=<int8|fp8> --calibration_data_path=calib_modelopt.npz
        --calibration_method=<entropy|max> --calibration_eps cpu
        --high_precision_dtype fp32 --output_path=modelopt_<method>.onnx

`--calibration_eps cpu`: no GPU here. `--high_precision_dtype fp32`: by
default ModelOpt converts the rest of an fp32 graph to fp16; every other
peer keeps float32 there, so this does too. A failure (no venv, install or
run error) is recorded with its error text.

`--quantize-mode fp8` runs ModelOpt's FP8 E4M3 PTQ instead (max
calibration only: ModelOpt's FP8 mode takes its ranges from amax) and
names its files `modelopt_fp8_*`.

Writes `modelopt.json` (`modelopt_fp8.json`) in the work folder.
"""

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from _peer_common import load_data, write_json  # noqa: E402

METHODS = {"int8": ("entropy", "max"), "fp8": ("max",)}
VERSION_PROBE = """
import importlib.metadata as m
for p in ("nvidia-modelopt", "torch", "onnx", "onnxruntime-gpu", "onnxruntime"):
    try:
        print(p, m.version(p), end="; ")
    except m.PackageNotFoundError:
        pass
"""


def run_modelopt(
    python, onnx_path, calib_path, method, dst, timeout, quantize_mode="int8"
):
    """Runs ModelOpt's ONNX PTQ on `onnx_path` in its own venv.

    Args:
        python: str. The ModelOpt venv's Python.
        onnx_path: str. The float ONNX.
        calib_path: str. An `.npz` of calibration inputs keyed by the ONNX
            input names.
        method: str. `"entropy"` or `"max"`.
        dst: str. Where the quantized ONNX goes; its log goes beside it
            (`.log` for `.onnx`).
        timeout: float. Seconds before the run is stopped.
        quantize_mode: str. ModelOpt's `--quantize_mode`: `"int8"` or
            `"fp8"`. Defaults to `"int8"`.

    Returns:
        dict: `command`, `seconds`, `ok`; with `onnx` (the file name) and
        `modelopt_says` (its count of quantized nodes) when it ran, else
        `returncode` and `error` (the last lines of its log).
    """
    if os.path.exists(dst):
        os.remove(dst)
    cmd = [
        python,
        "-m",
        "modelopt.onnx.quantization",
        f"--onnx_path={onnx_path}",
        f"--quantize_mode={quantize_mode}",
        f"--calibration_data_path={calib_path}",
        f"--calibration_method={method}",
        "--calibration_eps",
        "cpu",
        "--high_precision_dtype",
        "fp32",
        f"--output_path={dst}",
    ]
    start = time.perf_counter()
    try:
        run = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout
        )
        rc, log = run.returncode, run.stdout + run.stderr
    except subprocess.TimeoutExpired as e:
        rc, log = "timeout", f"timed out after {timeout} s: {e}"
    with open(os.path.splitext(dst)[0] + ".log", "w") as f:
        f.write(log)
    entry = {
        "command": "python " + " ".join(cmd[1:]),
        "seconds": round(time.perf_counter() - start, 1),
    }
    if rc == 0 and os.path.exists(dst):
        entry.update(ok=True, onnx=os.path.basename(dst))
        lines = [ln for ln in log.splitlines() if "quantized nodes" in ln]
        if lines:
            entry["modelopt_says"] = lines[-1].split(" - ")[-1]
    else:
        tail = [ln for ln in log.strip().splitlines() if ln.strip()][-15:]
        entry.update(ok=False, returncode=rc, error="\n".join(tail))
    return entry


def first_input_name(path):
    """The name of the first graph input of the ONNX file at `path` (the
    reference CNN's is `image`)."""
    import onnx

    return onnx.load(path, load_external_data=False).graph.input[0].name


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workdir", required=True)
    p.add_argument("--venv", required=True)
    p.add_argument(
        "--input-name",
        default=None,
        help="the ONNX input the calibration data feeds (default: the "
        "float ONNX's first input)",
    )
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--quantize-mode", default="int8", choices=tuple(METHODS))
    a = p.parse_args()
    prefix = "modelopt" if a.quantize_mode == "int8" else "modelopt_fp8"
    w = a.workdir
    python = os.path.join(a.venv, "bin", "python")
    out = {"venv": a.venv}
    if not os.path.exists(python):
        out["error"] = (
            f"No ModelOpt environment at {a.venv}. Create it with "
            "`python benchmarks/bench_peers.py --setup`."
        )
        write_json(w, prefix, out)
        return
    probe = subprocess.run(
        [python, "-c", VERSION_PROBE], capture_output=True, text=True
    )
    out["versions"] = (probe.stdout or probe.stderr).strip()[-500:]
    calib = os.path.join(w, "calib_modelopt.npz")
    name = a.input_name or first_input_name(os.path.join(w, "float.onnx"))
    np.savez(calib, **{name: load_data(w)["x_calib"]})
    methods = {}
    for method in METHODS[a.quantize_mode]:
        dst = os.path.join(w, f"{prefix}_{method}.onnx")
        entry = run_modelopt(
            python,
            os.path.join(w, "float.onnx"),
            calib,
            method,
            dst,
            a.timeout,
            a.quantize_mode,
        )
        entry["command"] = entry["command"].replace(w + os.sep, "")
        methods[method] = entry
        print(method, entry)
    out["methods"] = methods
    write_json(w, prefix, out)


if __name__ == "__main__":
    main()

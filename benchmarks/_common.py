"""Shared benchmark plumbing: versions, timing, atomic JSON + Markdown."""

import json
import os
import platform
import sys
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def versions():
    import keras
    import tensorflow as tf

    import keras_mp

    out = {
        "python": platform.python_version(),
        "keras_mp": keras_mp.__version__,
        "keras": keras.__version__,
        "tensorflow": tf.__version__,
        "cpu_count": os.cpu_count(),
    }
    for name in ("tf2onnx", "onnx", "onnxruntime"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            pass
    return out


def command_line():
    return "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])


def markdown_table(header, rows):
    lines = ["| " + " | ".join(header) + " |"]
    lines.append("|" + "---|" * len(header))
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(name, results, markdown):
    """Writes results/<name>.json and results/<name>.md atomically
    (`<name>_quick.*` for a `--quick` smoke run, so it never replaces the
    measured figures)."""
    from keras_mp.io import atomic_write_text

    if "--quick" in sys.argv:
        name += "_quick"

    os.makedirs(RESULTS, exist_ok=True)
    results = dict(results, command=command_line(), versions=versions())
    atomic_write_text(
        os.path.join(RESULTS, f"{name}.json"), json.dumps(results, indent=2)
    )
    stack = ", ".join(f"{k} {v}" for k, v in results["versions"].items())
    header = f"Command: `{results['command']}`\n\nVersions: {stack}\n\n"
    atomic_write_text(
        os.path.join(RESULTS, f"{name}.md"), header + markdown + "\n"
    )
    print(markdown)
    if not name.endswith("_quick"):
        from render_docs import render

        render()


def median_step_time(step, repeats):
    """Median wall time of `step()` over `repeats` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]

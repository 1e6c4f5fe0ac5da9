"""Shared benchmark plumbing: the command line every `bench_*.py` starts
from, versions, timing, and the results written as JSON + Markdown."""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


def bench_parser(doc, quick_help="smoke run"):
    """The command line of a benchmark: `--help` prints the script's
    docstring `doc`, `--quick` runs the smoke setting (`write_results`
    then writes `<name>_quick.*`, never the measured figures).

    Args:
        doc: str. The script's docstring.
        quick_help: str. What `--quick` does. Defaults to "smoke run".

    Returns:
        An `argparse.ArgumentParser`; add the script's own options to it.
    """
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help=quick_help)
    return parser


def add_only(parser, choices=None):
    """`--only NAME ...`: measure these rows only."""
    parser.add_argument(
        "--only",
        nargs="+",
        choices=choices,
        metavar="NAME",
        help="measure these rows only"
        + (f" (of {', '.join(choices)})" if choices else ""),
    )


def add_modelopt(parser, default):
    """`--modelopt VENV` (ModelOpt's venv, `default` unless given) and
    `--no-modelopt`; `modelopt_venv(args)` reads them."""
    parser.add_argument(
        "--modelopt",
        default=default,
        metavar="VENV",
        help=f"ModelOpt's venv (default {default})",
    )
    parser.add_argument("--no-modelopt", action="store_true")


def modelopt_versions(venv):
    """The versions of ModelOpt and its stack in `venv`, or None."""
    sys.path.insert(0, os.path.join(HERE, "peers"))
    from modelopt_peer import VERSION_PROBE

    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        return None
    probe = subprocess.run(
        [python, "-c", VERSION_PROBE], capture_output=True, text=True
    )
    return probe.stdout.strip().rstrip(";") or None


def modelopt_venv(args):
    """(venv, what the results say of ModelOpt) from `add_modelopt`'s
    options: (None, "not run (--no-modelopt)"), or the venv with its
    versions, or with "not run: no ModelOpt environment at <venv>"."""
    if args.no_modelopt:
        return None, "not run (--no-modelopt)"
    found = modelopt_versions(args.modelopt)
    return args.modelopt, (
        found or f"not run: no ModelOpt environment at {args.modelopt}"
    )


def verdicts_json(checks, key="measured"):
    """`{goal: {"pass": ok, key: text}}` of `{goal: (ok, text)}`: a
    benchmark's goals as its results store them."""
    return {
        goal: {"pass": ok, key: text} for goal, (ok, text) in checks.items()
    }


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


def write_results(name, results, markdown, quick=False):
    """Writes results/<name>.json (`results` with the command line and the
    versions) and results/<name>.md (the command line and versions, then
    `markdown`) atomically, prints `markdown`, and after a full run
    rebuilds docs/benchmarks.md (`render_docs.py`).

    Args:
        name: str. The benchmark's name (`"zoo"` for `bench_zoo.py`).
        results: dict. JSON-ready.
        markdown: str. The Markdown report.
        quick: bool. A `--quick` smoke run: writes `<name>_quick.*`
            instead, so it never replaces the measured figures, and leaves
            the docs alone. Defaults to False.
    """
    from keras_mp.io import atomic_write_text

    if quick:
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
    if not quick:
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

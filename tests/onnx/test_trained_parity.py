"""INT8 parity on trained networks (issue 15): Keras fake-quant and ONNX
Runtime agree on real Fashion-MNIST test images.

The measurement lives in `benchmarks/bench_trained_parity.py`, whose full
run writes the table in `docs/benchmarks.md`; this is its `--quick` run
(16,384 training images, one epoch, 2,000 test images), marked slow.
"""

import pytest

from benchmarks.bench_trained_parity import GOALS, MODELS, measure

# Findings of the quick run (`bench_trained_parity.py --quick`).
KNOWN_FAILURES = {
    "EfficientNetB0": "quick run, under-trained (float top-1 55.9%): "
    "Keras-vs-ORT agreement 99.20 / 98.70 / 99.00% (PTQ max / percentile / "
    "QAT) < 99.5%; the same Keras model under TensorFlow's Eigen kernels "
    "agrees 99.55 / 98.90 / 99.35% with itself, two of three below the "
    "goal from float summation order alone. The full run (one epoch of "
    "60,000 images) meets both goals.",
}


def _params():
    marks = {
        name: [pytest.mark.xfail(strict=True, reason=reason)]
        for name, reason in KNOWN_FAILURES.items()
    }
    return [pytest.param(n, marks=marks.get(n, []), id=n) for n in MODELS]


@pytest.mark.slow
@pytest.mark.parametrize("name", _params())
def test_trained_int8_parity(name, tmp_path):
    info, rows = measure(name, str(tmp_path), quick=True)
    assert [r["variant"] for r in rows] == [
        "float32",
        "ptq_max",
        "ptq_percentile",
        "qat",
    ]
    # trained well past a constant prediction (10%)
    assert info["float_top1"] > 0.5, info
    for row in rows:
        assert "export_error" not in row, row
        assert row["lint_ok"], row
        if row["variant"] != "float32":
            assert row["qdq_nodes"] > 0, row
            assert "compare_error" not in row, row
            assert row["compare_layers"] > 0, row
        assert row["top1_diff_points"] <= GOALS["max_top1_diff_points"], row
        assert row["agreement"] >= GOALS["min_agreement"], row

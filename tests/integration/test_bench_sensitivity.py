"""The sensitivity benchmark on real Fashion-MNIST, `--quick` setting (one
epoch on 16,384 training images, 2,000 test images), reference CNN only,
without ModelOpt, marked slow. Its full run writes
`benchmarks/results/sensitivity.*`."""

import pytest

from benchmarks.bench_sensitivity import MIN_QUANTIZED_FLOPS, measure


@pytest.mark.slow
@pytest.mark.gemm_rule  # the benchmark's setting: the 10-logit head float
def test_sensitivity_benchmark_quick():
    run = measure("reference_cnn", True, 0.005, ("latency", "bits"))
    assert run["float_top1"] > 0.3  # past chance (10%)
    assert "int8_top1" in run and "float8_top1" in run
    latency, bits = run["searches"]
    for row in (latency, bits):
        assert "error" not in row, row
        assert row["goal_flops"] == (
            row["quantized_flops"] >= MIN_QUANTIZED_FLOPS
        )
        assert row["val_drop"] <= 0.005  # the search's own budget
        p = row["predicted"]
        assert p["float"] / p["chosen"] == pytest.approx(
            row["speedup_over_fp16"]
        )
    # bits: weightless layers are free either way and stay float; every
    # weighted layer is 8-bit when the budget allows it
    assert bits["effective_bits"] == pytest.approx(8.0, abs=0.5)
    assert len(run["ranking"]) == 5
    assert {r["name"] for r in run["ranking"]} <= {
        "stem",
        "res_a",
        "res_b",
        "res_add",
        "dw",
        "pw",
        "conv3",
        "fc",
    }

"""`keras-mp demo --quick` end to end: the report says what happened."""

import json

import pytest

from keras_mp import cli
from keras_mp.cli import demo


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "report"
    assert cli.main(["demo", "--quick", "--output", str(out)]) == 0
    return out


def test_report_covers_every_method(quick_report):
    results = json.loads((quick_report / "results.json").read_text())
    assert results["data"].startswith("Fashion-MNIST")
    methods = results["methods"]
    expected = {"float32", "qat", "float32_control", "sparse_2_4_qat"}
    expected |= {f"ptq_{m}" for m in ("max", "percentile", "entropy", "mse")}
    assert set(methods) == expected
    for label, m in methods.items():
        assert m["tensorrt_lint"] == "clean", label
        assert m["parity_top1_agreement"] >= 99.9, label
        assert 0 < m["test_top1"] <= 100 and m["latency_ms_batch1"] > 0
        assert (m["qdq_nodes"] > 0) == (
            label not in ("float32", "float32_control")
        )
    # Pruned as NVIDIA ASP does: 5 convs/dense layers; the stem (1 input
    # channel), the depthwise conv and the 10-way logits stay dense.
    assert methods["sparse_2_4_qat"]["sparse_2_4_weights"] == 5
    eligible = {r["layer"]: r["eligible"] for r in results["sparsity"]}
    assert sum(eligible.values()) == 5 and not eligible["logits"]
    report = (quick_report / "report.md").read_text()
    assert "| qat |" in report and "Tensor Core audit" in report
    for plot in (
        "accuracy.png",
        "latency.png",
        "sparsity.png",
        "loss_scale.png",
    ):
        assert (quick_report / plot).stat().st_size > 1000
    # this CPU trains in float32: a short mixed_float16 run shows scaling
    probe = results["loss_scale_probe"]
    assert probe["steps"] == demo.QUICK_PROBE_STEPS
    assert probe["initial_scale"] <= 2.0**15
    assert probe["final_scale"] >= 1.0 and probe["skipped_steps"] >= 0
    steps = demo.QUICK_PROBE_STEPS
    assert f"Dynamic loss scaling ({steps} mixed_float16 steps" in report


def test_rerun_never_loses_a_report(quick_report, capsys):
    before = (quick_report / "report.md").read_text()
    assert cli.main(["demo", "--quick", "--output", str(quick_report)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (quick_report / "report.md").read_text() == before

"""`keras-mp demo --quick` end to end: the report says what happened.

The quick demo trains, calibrates and exports for about two minutes, so
these tests are marked `slow`: `.ci/run` runs them right after `make test`
(whose 10-minute budget they would break). The refusal to overwrite a
report needs no demo run and stays in `make test`.
"""

import json
import math

import keras
import pytest

import keras_mp
from keras_mp import cli
from keras_mp.cli import demo, demo_vit


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "report"
    assert cli.main(["demo", "--quick", "--output", str(out)]) == 0
    return out


@pytest.mark.slow
def test_report_covers_every_method(quick_report):
    results = json.loads((quick_report / "results.json").read_text())
    assert results["data"].startswith("Fashion-MNIST")
    methods = results["methods"]
    expected = {"float32", "qat", "float32_control", "sparse_2_4_qat"}
    expected |= {f"ptq_{m}" for m in demo.CALIBRATORS} | {"auto_quantize"}
    assert "auto" in demo.CALIBRATORS
    assert set(methods) == expected
    # export_onnx's own tolerance: looser when the model computes in 16 bits
    mixed = results["policy"]["name"].startswith("mixed")
    for label, m in methods.items():
        assert m["tensorrt_lint"] == "clean", label
        assert m["parity_top1_agreement"] >= (90.0 if mixed else 99.9), label
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
    clips = results["calibration_clips"]
    assert set(clips) == set(demo.CALIBRATORS) and clips["max"]["percent"] == 0
    assert "Largest share of one tensor's calibration inputs" in report
    # auto_quantize within its budget on its own images, its layers named
    auto = results["auto_quantize"]
    assert auto["drop_on_eval_images"] <= demo.AUTO_MAX_DROP
    assert {name for name, _ in auto["choices"]} >= {"stem", "res_a", "fc"}
    assert "| auto_quantize |" in report and "`auto_quantize`: INT8" in report
    for plot in (
        "accuracy.png",
        "latency.png",
        "sparsity.png",
        "loss_scale.png",
    ):
        assert (quick_report / plot).stat().st_size > 1000
    if "loss_scale_probe" in results:
        steps = demo.QUICK_PROBE_STEPS
        assert f"Dynamic loss scaling ({steps} mixed_float16 steps" in report


@pytest.mark.slow
def test_vit_row(quick_report):
    """The quick ViT row: a trained keras-hub ViT quantized in place, every
    weighted op and all four attention matmuls (2 layers: Q x K and
    softmax x V) behind Q/DQ, lint-clean, ONNX Runtime agreeing with Keras
    on the test images; without keras-hub the report says how to get it."""
    results = json.loads((quick_report / "results.json").read_text())
    report = (quick_report / "report.md").read_text()
    vit = results["vit"]
    if demo_vit.keras_hub_or_none() is None:
        assert vit == {"skipped": demo_vit.INSTALL_HINT}
        assert demo_vit.INSTALL_HINT in report
        return
    assert set(vit["methods"]) == {"float32", "ptq_percentile"}
    assert vit["train_images"] == demo_vit.QUICK_TRAIN_IMAGES
    fp, ptq = vit["methods"]["float32"], vit["methods"]["ptq_percentile"]
    assert fp["test_top1"] > 40  # trained well past chance (10%)
    assert ptq["test_top1"] >= fp["test_top1"] - 2.0
    assert ptq["tensorrt_lint"] == "clean" and ptq["qdq_nodes"] > 0
    # patch conv + 2 x (Q, K, V, output, 2 MLP) + head, and 2 x 2 matmuls
    assert ptq["weighted_ops"] == ptq["weighted_quantized"] == 18
    assert ptq["attention_matmuls"] == ptq["attention_quantized"] == 4
    assert ptq["parity_top1_agreement"] >= 99.5
    assert abs(ptq["ort_test_top1"] - ptq["test_top1"]) <= 0.5
    assert (quick_report / "vit_ptq_percentile.onnx").stat().st_size > 1000
    assert "| vit_ptq_percentile |" in report and "18 / 18 | 4 / 4" in report


@pytest.mark.slow
def test_loss_scale_probe_is_consistent(quick_report):
    """A CPU trains in float32 or bfloat16, so a short mixed_float16 run of
    a copy shows dynamic loss scaling; its figures must add up."""
    results = json.loads((quick_report / "results.json").read_text())
    if results["policy"]["name"] == "mixed_float16":
        pytest.skip("the training run itself used loss scaling: no probe")
    probe = results["loss_scale_probe"]
    steps = demo.QUICK_PROBE_STEPS
    assert probe["steps"] == steps
    default = keras_mp.LossScaleOptimizer(keras.optimizers.SGD())
    assert probe["initial_scale"] == default.initial_scale == 2.0**15
    history = probe["scale_history"]
    assert len(history) == steps
    assert all(math.log2(s).is_integer() for s in history), history
    # every change is a skipped step (halving) or a growth (doubling)
    before = [probe["initial_scale"]] + history[:-1]
    halved = sum(b == 2 * a for a, b in zip(history, before))
    doubled = sum(a == 2 * b for a, b in zip(history, before))
    changes = sum(a != b for a, b in zip(history, before))
    assert halved + doubled == changes
    assert halved == probe["skipped_steps"]
    assert doubled <= (steps - halved) // probe["growth_steps"]
    assert probe["final_scale"] == history[-1]


def test_rerun_never_loses_a_report(tmp_path, capsys):
    """A second run into the same folder is refused before any training,
    and the earlier report is left as it was."""
    earlier = tmp_path / "report"
    earlier.mkdir()
    (earlier / "report.md").write_text("# an earlier demo report\n")
    (earlier / "results.json").write_text("{}")
    assert cli.main(["demo", "--quick", "--output", str(earlier)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (earlier / "report.md").read_text() == "# an earlier demo report\n"
    assert sorted(p.name for p in earlier.iterdir()) == [
        "report.md",
        "results.json",
    ]

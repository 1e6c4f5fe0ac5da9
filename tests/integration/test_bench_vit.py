"""The ViT benchmark (issue 16, item 7) on real Fashion-MNIST: a keras-hub
ViT quantized in place meets the PTQ, QAT, coverage and ONNX parity goals.

The measurement lives in `benchmarks/bench_vit.py`, whose full run writes
`benchmarks/results/vit.*`; this is its `--quick` run (4,096 training
images, one epoch, 2,000 test images), marked slow. Without keras-hub,
`measure` fails with the install command.
"""

import pytest

from benchmarks.bench_vit import CALIBRATORS, QUICK, measure, verdicts


@pytest.mark.slow
def test_vit_benchmark_quick(tmp_path):
    run = measure(0, str(tmp_path), quick=True)
    assert run["train_images"] == QUICK["train_images"]
    labels = {"float32", "qat", "float32_control"}
    assert set(run["methods"]) == labels | {f"ptq_{m}" for m in CALIBRATORS}
    assert run["methods"]["float32"]["test_top1"] > 50  # past chance (10%)
    for label, row in run["methods"].items():
        int8 = not label.startswith("float32")
        assert (row["qdq_nodes"] > 0) == int8, label
        # patch conv + 2 x (Q, K, V, output, 2 MLP) + head; 2 x 2 matmuls
        assert row["weighted_ops"] == 18 and row["attention_matmuls"] == 4
    failed = {n: text for n, (ok, text) in verdicts(run).items() if not ok}
    assert not failed, failed

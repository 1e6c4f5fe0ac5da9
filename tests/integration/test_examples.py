"""Every example runs with `--quick` and leaves what it promises; the
generated docs page is up to date; the docs build with `--strict`.

The examples run in this process (`runpy`, patched `sys.argv`) so that
TensorFlow is imported once. Each test checks the example's artifacts
itself (the ONNX file passes the TensorRT lint, the saved model reloads),
not only that the script finished.
"""

import pathlib
import runpy
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_mp

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TESTED = {
    "mixed_precision_quickstart",
    "ptq_calibrate_export",
    "qat_keras_applications",
    "sparsity_qat",
    "muppet",
    "recommender",
}


def run_example(name, output, monkeypatch, *args):
    """Runs examples/<name>.py --quick --output <output>; returns its
    module globals."""
    argv = [f"{name}.py", "--quick", "--output", str(output), *args]
    monkeypatch.setattr(sys, "argv", argv)
    return runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name="__main__")


def test_every_example_has_a_smoke_test():
    found = {path.stem for path in EXAMPLES.glob("*.py")}
    assert found == TESTED, "add the new example to TESTED and test it here"


@pytest.mark.slow  # run by .ci/run after `make test` (10-minute budget)
def test_mixed_precision_quickstart(tmp_path, monkeypatch, capsys):
    run_example("mixed_precision_quickstart", tmp_path, monkeypatch)
    out = capsys.readouterr().out
    assert "'loss_scale'" in out and "'skipped_steps'" in out
    assert "reloaded with keras.saving.load_model: True" in out
    assert keras.mixed_precision.global_policy().name == "float32"
    model = keras.saving.load_model(tmp_path / "model.keras")
    assert isinstance(model.optimizer, keras_mp.LossScaleOptimizer)
    dtypes = {layer.name: layer.compute_dtype for layer in model.layers}
    assert dtypes["logits"] == "float32"
    assert "float16" in dtypes.values()


@pytest.mark.slow  # run by .ci/run after `make test` (10-minute budget)
def test_ptq_calibrate_export(tmp_path, monkeypatch, capsys):
    run_example("ptq_calibrate_export", tmp_path, monkeypatch)
    out = capsys.readouterr().out
    for method in ("max", "percentile", "entropy", "mse"):
        assert f"PTQ {method}" in out
    (onnx_path,) = tmp_path.glob("ptq_*.onnx")
    lint = keras_mp.check_tensorrt(onnx_path)
    assert lint.ok, str(lint)
    assert lint.weighted_ops == lint.weighted_ops_quantized > 0
    assert keras_mp.trtexec_command(onnx_path, lint) in out


@pytest.mark.slow  # run by .ci/run after `make test` (10-minute budget)
def test_sparsity_qat(tmp_path, monkeypatch, capsys):
    run_example("sparsity_qat", tmp_path, monkeypatch)
    out = capsys.readouterr().out
    lint = keras_mp.check_tensorrt(tmp_path / "sparse_qat.onnx")
    assert lint.ok, str(lint)
    # The reference CNN has 5 kernels ASP would prune (stem, depthwise and
    # the 10-way logits stay dense); all of them must still be 2:4 after
    # QAT, in the ONNX file.
    assert len(lint.sparse_weights) == 5
    assert "--sparsity=enable" in out
    assert "skipping logits: 32 input / 10 output channels" in out
    assert "After QAT, 2:4 holds in 5/5 kernels." in out
    assert (tmp_path / "sparsity.png").stat().st_size > 1000


@pytest.mark.slow  # run by .ci/run after `make test` (10-minute budget)
def test_muppet(tmp_path, monkeypatch, capsys):
    run_example("muppet", tmp_path, monkeypatch)
    out = capsys.readouterr().out
    # --quick: a fixed schedule that visits every precision in 6 epochs.
    assert "[8.0, 12.0, 14.0, 14.0, 16.0, 32.0]" in out
    assert "Switch epochs: [1, 2, 4, 5]" in out
    assert "cost model, not a measurement" in out
    assert (tmp_path / "precision.png").stat().st_size > 1000


@pytest.mark.slow  # run by .ci/run after `make test` (10-minute budget)
def test_recommender(tmp_path, monkeypatch, capsys):
    example = run_example("recommender", tmp_path, monkeypatch)
    out = capsys.readouterr().out
    assert "SYNTHETIC click data" in out
    assert keras.mixed_precision.global_policy().name == "float32"
    ort = pytest.importorskip("onnxruntime")
    features, _, _ = example["synthetic_clicks"](64, seed=5)
    for name in ("wide_and_deep", "dlrm"):
        session = ort.InferenceSession(
            str(tmp_path / f"{name}.onnx"),
            providers=["CPUExecutionProvider"],
        )
        (only,) = session.get_inputs()
        (logits,) = session.run(None, {only.name: features})
        assert logits.shape == (64, 1) and np.all(np.isfinite(logits))
        assert np.std(logits) > 0  # the ids and features reach the output
    # The GRU session model: INT8 Dense head, the GRU float inside a Loop.
    assert "SYNTHETIC sessions" in out and "next_item: INT8" in out
    path = tmp_path / "session_gru_int8.onnx"
    lint = keras_mp.check_tensorrt(path)
    assert lint.ok, str(lint)
    assert lint.weighted_ops_quantized == 1 < lint.weighted_ops, str(lint)
    history, _, _ = example["synthetic_sessions"](64, seed=5)
    assert (history == 0).any()  # left padding, masked by the Embedding
    session = ort.InferenceSession(
        str(path), providers=["CPUExecutionProvider"]
    )
    (scores,) = session.run(None, {session.get_inputs()[0].name: history})
    assert scores.shape == (64, 1000) and np.all(np.isfinite(scores))


@pytest.mark.slow
def test_qat_keras_applications(tmp_path, monkeypatch, capsys):
    # MobileNetV2 QAT traces ~150 layers twice: a few minutes on 2 cores.
    run_example("qat_keras_applications", tmp_path, monkeypatch)
    out = capsys.readouterr().out
    assert "QAT test top-1" in out
    lint = keras_mp.check_tensorrt(tmp_path / "mobilenetv2_qat.onnx")
    assert lint.ok, str(lint)
    assert not lint.warnings, str(lint)
    # Every Conv, depthwise Conv and the Dense head is INT8 on both inputs.
    assert lint.weighted_ops == lint.weighted_ops_quantized >= 50


def test_support_matrix_is_up_to_date():
    generator = runpy.run_path(str(ROOT / "docs" / "gen_support_matrix.py"))
    committed = (ROOT / "docs" / "support_matrix.md").read_text()
    assert generator["render"]() == committed, (
        "docs/support_matrix.md is stale: run python docs/gen_support_matrix.py"
    )


def test_docs_build_strict(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--quiet",
            "--site-dir",
            str(tmp_path / "site"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "site" / "support_matrix" / "index.html").exists()

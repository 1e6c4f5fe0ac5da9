"""The `keras-mp` command line: each subcommand, and every bad command
line exiting with code 2 and one error line (no traceback)."""

import json
import os
import re
import zipfile

import keras
import numpy as np
import onnx
import pytest
from onnx import helper

import keras_mp
from keras_mp import cli
from tests.conftest import small_cnn


def test_info_prints_versions_devices_and_policies(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for key in ("keras_mp", "tensorflow", "tf2onnx", "onnxruntime", "devices"):
        assert key in out
    assert "auto policy" in out and "mixed_bfloat16" in out


def test_cli_export_and_lint(tmp_path, capsys):
    x = np.random.default_rng(0).random((16, 28, 28, 1), dtype=np.float32)
    model = small_cnn()
    model.save(tmp_path / "m.keras")
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "m.onnx"
    code = cli.main(
        [
            "export",
            str(tmp_path / "m.keras"),
            "--onnx",
            str(out),
            "--calibrate",
            str(tmp_path / "x.npy"),
            "--verify",
            str(tmp_path / "x.npy"),
        ]
    )
    text = capsys.readouterr().out
    assert code == 0 and out.exists()
    assert "trtexec --onnx=" in text and "--stronglyTyped" in text
    assert "top-1 agreement 100.00%" in text
    assert cli.main(["lint", str(out)]) == 0
    (tmp_path / "bad.onnx").write_bytes(b"not onnx")
    assert cli.main(["lint", str(tmp_path / "bad.onnx")]) == 2
    assert "bad.onnx" in capsys.readouterr().err
    assert (
        cli.main(["export", str(tmp_path / "nope.keras"), "--onnx", "x"]) == 2
    )


def _saved_cnn(tmp_path, n):
    """`small_cnn` saved, `n` inputs in `x.npy`, and the export argv."""
    x = np.random.default_rng(0).random((n, 28, 28, 1), dtype=np.float32)
    small_cnn().save(tmp_path / "m.keras")
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "m.onnx"
    return out, ["export", str(tmp_path / "m.keras"), "--onnx", str(out)]


def test_cli_fp16_export_verifies_on_the_calibration_data(tmp_path, capsys):
    out, argv = _saved_cnn(tmp_path, 16)
    code = cli.main(argv + ["--calibrate", str(tmp_path / "x.npy"), "--fp16"])
    text = capsys.readouterr().out
    assert code == 0 and "top-1 agreement 100.00%" in text
    assert "--minShapes=input_0:1x28x28x1" in text
    proto = onnx.load(out)
    assert max(o.version for o in proto.opset_import if o.domain == "") == 19
    assert cli.main(argv + ["--overwrite"]) == 0
    assert "No parity check" in capsys.readouterr().out


def test_cli_dtype_prints_the_float32_nodes_and_why(tmp_path, capsys):
    _, argv = _saved_cnn(tmp_path, 8)
    verify = ["--verify", str(tmp_path / "x.npy")]
    with pytest.warns(UserWarning, match="bfloat16': parity not checked"):
        code = cli.main(argv + verify + ["--dtype", "bfloat16"])
    text = capsys.readouterr().out
    assert code == 0
    assert re.search(r"bfloat16 graph: \d+ of \d+ nodes kept float32", text)
    assert "output layer" in text and "No parity check" not in text
    with pytest.raises(SystemExit) as exit_info:  # argparse's choices
        cli.main(argv + ["--overwrite", "--dtype", "float8"])
    assert exit_info.value.code == 2


def _tiny_onnx(path):
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
    )
    onnx.save(helper.make_model(graph), path)


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    """The files the bad command lines point at (made once)."""
    d = tmp_path_factory.mktemp("bad_cli")
    x = np.random.default_rng(0).random((32, 8, 8, 4), dtype=np.float32)
    model = keras.Sequential(
        [
            keras.Input((8, 8, 4)),
            keras.layers.Conv2D(8, 3, name="conv"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(4),
        ]
    )
    model.save(d / "m.keras")
    quantized = keras_mp.quantize_model(model)
    keras_mp.calibrate(quantized, x, verbose=0)
    quantized.save(d / "q.keras")
    lam = keras.Sequential(
        [keras.Input((4,)), keras.layers.Lambda(lambda v: 2 * v)]
    )
    lam.save(d / "lambda.keras")
    (d / "junk.keras").write_bytes(b"not a zip file")
    with zipfile.ZipFile(d / "noconfig.keras", "w") as z:
        z.writestr("metadata.json", json.dumps({"keras_version": "3.15.1"}))
    np.save(d / "x.npy", x)
    np.save(d / "y.npy", np.arange(32) % 4)
    np.save(d / "x3d.npy", x[..., 0])
    np.save(d / "pickled.npy", np.array([{"a": 1}], dtype=object))
    (d / "existing.onnx").write_bytes(b"previous")
    (d / "junk.onnx").write_bytes(b"\x08\x07junk, not protobuf \xff\xfe")
    (d / "empty.onnx").write_bytes(b"")
    _tiny_onnx(str(d / "valid.onnx"))
    os.makedirs(d / "report")
    (d / "report" / "report.md").write_text("an earlier report")
    os.makedirs(d / "existing_sm")
    return d


def _onnx_out(d, *extra):
    return ["--onnx", f"{d}/o.onnx", *extra]


# (id, argv from the fixture folder, message on stderr)
BAD_CLI = [
    ("no_subcommand", lambda d: [], "required: command"),
    ("export_no_model", lambda d: ["export"], "required: model"),
    (
        "export_opset_not_a_number",
        lambda d: ["export", f"{d}/m.keras", "--opset", "x"],
        "invalid int value: 'x'",
    ),
    (
        "export_nothing_to_do",
        lambda d: ["export", f"{d}/m.keras"],
        "Nothing to do: pass --onnx OUT.onnx and/or --saved-model DIR",
    ),
    (
        "export_missing_model",
        lambda d: ["export", f"{d}/none.keras", *_onnx_out(d)],
        "Could not load .*none.keras",
    ),
    (
        "export_junk_model",
        lambda d: ["export", f"{d}/junk.keras", *_onnx_out(d)],
        "Could not load .*junk.keras",
    ),
    (
        "export_zip_without_config",
        lambda d: ["export", f"{d}/noconfig.keras", *_onnx_out(d)],
        "Could not load .*noconfig.keras",
    ),
    (
        "export_unsafe_lambda_model",
        lambda d: ["export", f"{d}/lambda.keras", *_onnx_out(d)],
        "Could not load .*lambda.keras.*Lambda",
    ),
    (
        "export_calibration_file_missing",
        lambda d: [
            "export",
            f"{d}/m.keras",
            *_onnx_out(d, "--calibrate", f"{d}/none.npy"),
        ],
        "Could not read .*none.npy as a .npy array",
    ),
    (
        "export_calibration_file_pickled",
        lambda d: [
            "export",
            f"{d}/m.keras",
            *_onnx_out(d, "--calibrate", f"{d}/pickled.npy"),
        ],
        "Could not read .*pickled.npy as a .npy array.*allow_pickle",
    ),
    (
        "export_calibration_wrong_shape",
        lambda d: [
            "export",
            f"{d}/m.keras",
            *_onnx_out(d, "--calibrate", f"{d}/x3d.npy"),
        ],
        r"input 'input_0' has shape \(32, 8, 8\).*expects",
    ),
    (
        "export_unknown_method",
        lambda d: [
            "export",
            f"{d}/m.keras",
            *_onnx_out(d, "--calibrate", f"{d}/x.npy", "--method", "kl"),
        ],
        "Unknown calibration method",
    ),
    (
        "export_calibrate_quantized_model",
        lambda d: [
            "export",
            f"{d}/q.keras",
            *_onnx_out(d, "--calibrate", f"{d}/x.npy"),
        ],
        "already quantized",
    ),
    (
        "export_old_opset",
        lambda d: ["export", f"{d}/m.keras", *_onnx_out(d, "--opset", "11")],
        "opset >= 13",
    ),
    (
        "export_existing_output",
        lambda d: ["export", f"{d}/m.keras", "--onnx", f"{d}/existing.onnx"],
        "existing.onnx exists.*--overwrite",
    ),
    (
        "export_missing_output_folder",
        lambda d: ["export", f"{d}/m.keras", "--onnx", f"{d}/no/o.onnx"],
        "folder .*no does not exist",
    ),
    (
        "export_verify_missing",
        lambda d: [
            "export",
            f"{d}/m.keras",
            *_onnx_out(d, "--verify", f"{d}/none.npy"),
        ],
        "Could not read .*none.npy",
    ),
    (
        "export_verify_wrong_shape",
        lambda d: [
            "export",
            f"{d}/m.keras",
            "--onnx",
            f"{d}/vw.onnx",
            "--verify",
            f"{d}/x3d.npy",
        ],
        r"verify.*\(32, 8, 8\)",
    ),
    (
        "export_saved_model_existing",
        lambda d: [
            "export",
            f"{d}/m.keras",
            "--saved-model",
            f"{d}/existing_sm",
        ],
        "existing_sm exists",
    ),
    ("lint_missing_file", lambda d: ["lint", f"{d}/none.onnx"], "No ONNX file"),
    (
        "lint_junk_file",
        lambda d: ["lint", f"{d}/junk.onnx"],
        "not a readable ONNX model",
    ),
    ("lint_empty_file", lambda d: ["lint", f"{d}/empty.onnx"], "not an ONNX"),
    ("lint_keras_file", lambda d: ["lint", f"{d}/m.keras"], "m.keras' is not"),
    (
        "demo_existing_report",
        lambda d: ["demo", "--output", f"{d}/report"],
        "already holds a report. Pass --overwrite",
    ),
    (
        "info_unknown_option",
        lambda d: ["info", "--gpu"],
        "unrecognized arguments: --gpu",
    ),
    (
        "unknown_subcommand",
        lambda d: ["frobnicate"],
        "invalid choice: 'frobnicate'",
    ),
    (
        "lint_two_files",
        lambda d: ["lint", f"{d}/valid.onnx", f"{d}/junk.onnx"],
        "unrecognized arguments",
    ),
    (
        "sensitivity_no_data",
        lambda d: ["sensitivity", f"{d}/m.keras"],
        "required: --data",
    ),
    (
        "sensitivity_labels_unreadable",
        lambda d: [
            "sensitivity",
            f"{d}/m.keras",
            "--data",
            f"{d}/x.npy",
            "--labels",
            f"{d}/pickled.npy",
        ],
        "Could not read .*pickled.npy",
    ),
    (
        "sensitivity_unknown_precision",
        lambda d: [
            "sensitivity",
            f"{d}/m.keras",
            "--data",
            f"{d}/x.npy",
            "--precisions",
            "int4",
        ],
        r"precisions=\)` must be one of \['int8', 'float8'\].*"
        "Received: precisions='int4'",
    ),
    (
        "sensitivity_quantized_model",
        lambda d: ["sensitivity", f"{d}/q.keras", "--data", f"{d}/x.npy"],
        "already quantized",
    ),
    (
        "auto_quantize_without_data",
        lambda d: ["export", f"{d}/m.keras", "--auto-quantize", *_onnx_out(d)],
        "--auto-quantize needs data",
    ),
    (
        "auto_quantize_negative_drop",
        lambda d: [
            "export",
            f"{d}/m.keras",
            "--auto-quantize",
            "--max-drop=-0.1",
            *_onnx_out(d, "--calibrate", f"{d}/x.npy"),
        ],
        "max_drop` must be a number >= 0",
    ),
    (
        "auto_quantize_fp8_on_a_t4",
        lambda d: [
            "export",
            f"{d}/m.keras",
            "--auto-quantize",
            "--gpu",
            "T4",
            *_onnx_out(d, "--calibrate", f"{d}/x.npy"),
        ],
        "float8 cannot run on T4",
    ),
    (
        "auto_quantize_unknown_gpu",
        lambda d: [
            "export",
            f"{d}/m.keras",
            "--auto-quantize",
            "--gpu",
            "V100",
            *_onnx_out(d, "--calibrate", f"{d}/x.npy"),
        ],
        "Unknown GPU: 'V100'. Known GPUs: T4, A100",
    ),
]


@pytest.mark.parametrize(
    "argv, match", [c[1:] for c in BAD_CLI], ids=[c[0] for c in BAD_CLI]
)
def test_bad_command_line_exits_2_with_one_error_line(
    bad_files, capsys, argv, match
):
    try:
        code = cli.main(argv(bad_files))
    except SystemExit as exit_:  # argparse usage errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    assert re.search(match, err, re.S), err


def test_cli_export_takes_an_npz_by_input_name(tmp_path, capsys):
    ids = keras.Input((6,), dtype="int32", name="token_ids")
    feats = keras.Input((3,), name="features")
    h = keras.layers.GlobalAveragePooling1D()(
        keras.layers.Embedding(20, 8)(ids)
    )
    h = keras.layers.Concatenate()([h, keras.layers.Dense(4)(feats)])
    model = keras.Model(
        {"token_ids": ids, "features": feats}, keras.layers.Dense(4)(h)
    )
    model.save(tmp_path / "t.keras")
    rng = np.random.default_rng(0)
    token_ids = rng.integers(0, 20, (16, 6)).astype(np.int32)
    features = rng.random((16, 3), np.float32)
    np.savez(tmp_path / "x.npz", token_ids=token_ids, features=features)
    np.savez(tmp_path / "bad.npz", ids=token_ids, features=features)
    out = tmp_path / "t.onnx"
    argv = ["export", str(tmp_path / "t.keras"), "--onnx", str(out)]
    assert cli.main(argv + ["--calibrate", str(tmp_path / "x.npz")]) == 0
    assert "top-1 agreement" in capsys.readouterr().out
    graph = onnx.load(out).graph
    assert {i.name: i.type.tensor_type.elem_type for i in graph.input} == {
        "features": onnx.TensorProto.FLOAT,
        "token_ids": onnx.TensorProto.INT32,
    }
    bad = argv[:-1] + [str(tmp_path / "b.onnx")]
    assert cli.main(bad + ["--calibrate", str(tmp_path / "bad.npz")]) == 2
    err = capsys.readouterr().err
    assert "missing: ['token_ids'], unexpected: ['ids']" in err
    assert not (tmp_path / "b.onnx").exists()


def test_cli_sensitivity_prints_the_table_and_writes_json_and_plot(
    bad_files, tmp_path, capsys
):
    d = bad_files
    argv = ["sensitivity", f"{d}/m.keras", "--data", f"{d}/x.npy"]
    argv += ["--labels", f"{d}/y.npy", "--batches", "1"]
    argv += ["--json", f"{tmp_path}/s.json", "--plot", f"{tmp_path}/s.png"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "gradient score" in out and "conv" in out and "float8" in out
    raw = json.loads((tmp_path / "s.json").read_text())
    assert raw["method"] == "gradient" and raw["rows"]
    assert (tmp_path / "s.png").stat().st_size > 1000
    argv = ["sensitivity", f"{d}/m.keras", "--data", f"{d}/x.npy"]
    assert cli.main(argv + ["--batches", "1", "--metric", "top1"]) == 0
    out = capsys.readouterr().out
    assert "drop of " in out and "with the layer alone quantized" in out


def test_cli_export_auto_quantize(bad_files, tmp_path, capsys):
    d = bad_files
    out = tmp_path / "auto.onnx"
    argv = ["export", f"{d}/m.keras", "--auto-quantize", "--max-drop", "1"]
    argv += ["--calibrate", f"{d}/x.npy", "--labels", f"{d}/y.npy"]
    argv += ["--gpu", "L40S", "--onnx", str(out)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "auto_quantize (latency on L40S)" in text
    assert "predicted speed-up over float16" in text
    assert out.exists() and "top-1 agreement" in text

"""`keras-mp compare`: exit 0 on a faithful export, 1 where a layer
diverges, 2 with one error line on bad input."""

import numpy as np

from keras_mp import cli
from tests.onnx.test_compare import break_second_conv, exported  # noqa: F401
from tests.onnx.test_compare_nested import custom_export  # noqa: F401


def test_cli_compare(exported, tmp_path, capsys):  # noqa: F811
    qmodel, path, x = exported
    qmodel.save(tmp_path / "q.keras")
    np.savez(tmp_path / "x.npz", **{qmodel.inputs[0].name: x})
    args = ["compare", str(tmp_path / "q.keras"), path]
    png = str(tmp_path / "err.png")
    code = cli.main(args + ["--data", str(tmp_path / "x.npz"), "--plot", png])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "no layer diverges" in out and "Plot written" in out

    np.save(tmp_path / "x.npy", x)
    bad = break_second_conv(path, str(tmp_path / "bad.onnx"))
    args[2] = bad
    code = cli.main(
        args + ["--data", str(tmp_path / "x.npy"), "--samples", "4"]
    )
    assert code == 1
    assert "first divergence at layer" in capsys.readouterr().out

    np.save(tmp_path / "wrong.npy", x[:, :8])
    code = cli.main(args + ["--data", str(tmp_path / "wrong.npy")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "expects" in err


def test_cli_compare_reaches_inside_a_quantized_model(
    custom_export,  # noqa: F811
    tmp_path,
    capsys,
):
    """A `.keras` RecordedModel (layers inside custom layers) reloads and
    is compared layer by layer, inner layers by their path."""
    qmodel, path, x = custom_export
    qmodel.save(tmp_path / "q.keras")
    np.save(tmp_path / "x.npy", x)
    code = cli.main(
        ["compare", str(tmp_path / "q.keras"), path]
        + ["--data", str(tmp_path / "x.npy")]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "| custom/block/fc | QuantizedDense |" in out
    assert "Not compared" not in out
    assert "no layer diverges" in out

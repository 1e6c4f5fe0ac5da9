import pytest

from keras_mp import cli


def test_info_prints_versions_devices_and_policies(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for key in ("keras_mp", "tensorflow", "tf2onnx", "onnxruntime", "devices"):
        assert key in out
    assert "auto policy" in out and "mixed_bfloat16" in out


def test_unknown_subcommand_exits_with_usage(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["frobnicate"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err

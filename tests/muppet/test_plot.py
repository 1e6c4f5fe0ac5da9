"""`plot_precision`."""

import math
import os
import sys

import pytest

from keras_mp.muppet import PrecisionSwitching, plot_precision


def test_plot_precision_writes_png(tmp_path):
    cb = PrecisionSwitching()
    cb.history = {
        "epoch": [0, 1, 2],
        "precision": [8, 8, 12],
        "p": [math.nan, math.nan, 1.3],
        "T": [2.5, 2.36, 2.23],
    }
    path = plot_precision(cb, str(tmp_path / "p.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(tmp_path) == ["p.png"]


def test_plot_without_matplotlib_names_the_extra(monkeypatch, tmp_path):

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"keras-mp\[plot\]"):
        plot_precision({"precision": [8]}, str(tmp_path / "p.png"))


@pytest.mark.parametrize("history", [[8, 8], {"p": [1.0]}])
def test_without_a_precision_history_says_what_it_needs(tmp_path, history):
    with pytest.raises(
        ValueError,
        match="needs a PrecisionSwitching callback, or the History .* "
        "without 'precision'",
    ):
        plot_precision(history, str(tmp_path / "p.png"))


def test_missing_folder_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="folder .*no does not exist"):
        plot_precision({"precision": [8, 8]}, str(tmp_path / "no" / "p.png"))

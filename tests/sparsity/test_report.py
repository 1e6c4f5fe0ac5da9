"""`sparsity_report` and `plot_sparsity`."""

import os

import keras
import pytest

from keras_mp.sparsity import plot_sparsity, sparsity_report
from tests.conftest import tf_keras_like
from tests.sparsity.conftest import sparse_model


def test_report_and_plot(tmp_path):
    model = sparse_model()
    report = sparsity_report(model)
    names = [r.name for r in report.rows]
    assert names == ["conv_a", "sep", "deconv", "dw", "fc", "head"]
    dw = report.rows[3]
    assert not dw.eligible and "depthwise" in dw.reason
    fc = report.rows[4]
    assert fc.eligible and not fc.pattern_valid and fc.fraction_zero == 0.0
    assert 0.5 < fc.kept_magnitude < 1.0
    table = str(report)
    assert "depthwise" in table and "kept |w|" in table
    assert report.to_dict()["rows"][4]["name"] == "fc"
    path = str(tmp_path / "sparsity.png")
    assert plot_sparsity(report, path) == path
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(tmp_path) == ["sparsity.png"]


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"keras-mp\[plot\]"):
        plot_sparsity(sparse_model(), str(tmp_path / "x.png"))


def test_bad_inputs(tmp_path):
    with pytest.raises(
        TypeError,
        match=r"`sparsity_report` expects a Keras 3 `keras.Model`. Received: "
        r"tf_keras.src.engine.sequential.Sequential. tf_keras \(Keras 2\)",
    ):
        sparsity_report(tf_keras_like())
    with pytest.raises(
        FileNotFoundError, match="folder .*no does not exist. Create it first"
    ):
        plot_sparsity(sparse_model(), str(tmp_path / "no" / "s.png"))


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class _QueryBlock(keras.layers.Layer):
    """Two blocks of this each hold a sublayer named `query`, as every
    keras-hub encoder block does."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.query = keras.layers.Dense(16, name="query")

    def build(self, input_shape):
        self.query.build(input_shape)

    def call(self, x):
        return self.query(x)


def nested_blocks():
    inputs = keras.Input((16,))
    x = _QueryBlock(name="block_0")(inputs)
    x = _QueryBlock(name="block_1")(x)
    return keras.Model(
        inputs, keras.layers.Dense(8, name="head")(x), name="blocks"
    )


def test_nested_layers_are_named_by_path():
    names = [r.name for r in sparsity_report(nested_blocks()).rows]
    assert names == ["block_0/query", "block_1/query", "head"]

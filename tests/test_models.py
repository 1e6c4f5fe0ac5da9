"""The one layer walker and the model checks every feature uses."""

import keras
import pytest

from keras_mp import _keras, _models
from tests.conftest import Subclassed, tf_keras_like

L = keras.layers


class Block(keras.layers.Layer):
    """A custom layer holding sublayers in an attribute and a list, and one
    layer twice (shared weights)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.proj = L.Dense(8, name="proj")
        self.branches = [L.Dense(8, name="left"), L.Dense(8, name="right")]
        self.shared = self.proj

    def call(self, x):
        x = self.proj(x)
        return self.branches[0](x) + self.branches[1](x)


def _nested():
    inner = keras.Sequential(
        [keras.Input((8,)), L.Dense(8, name="inner_dense")], name="inner"
    )
    inputs = keras.Input((8,))
    x = Block(name="block")(inner(inputs))
    wrapped = L.TimeDistributed(L.Dense(2, name="td_dense"), name="td")
    x = wrapped(L.Reshape((4, 2))(x))
    return keras.Model(inputs, L.Flatten()(x), name="outer")


def test_walk_reaches_nested_models_custom_layers_and_wrappers():
    names = [layer.name for layer in _models.walk_layers(_nested())]
    for name in ("inner_dense", "block", "proj", "left", "right", "td_dense"):
        assert name in names, name
    assert "inner" not in names  # models entered, not listed by default
    assert len(names) == len(set(names))  # the shared layer comes once
    # parents come before their children
    assert names.index("block") < names.index("proj")
    assert names.index("td") < names.index("td_dense")


def test_walk_lists_models_and_stops_where_asked():
    model = _nested()
    with_models = [layer.name for layer in _models.walk_layers(model, True)]
    assert with_models.index("inner") < with_models.index("inner_dense")
    stopped = [
        layer.name
        for layer in _models.walk_layers(model, stop_at=(Block, L.Wrapper))
    ]
    assert "block" in stopped and "td" in stopped
    assert not {"proj", "left", "right", "td_dense"} & set(stopped)


def test_model_checks_name_the_caller_and_the_alternative():
    with pytest.raises(TypeError, match=r"`caller` expects a Keras 3"):
        _models.check_model(object(), "caller")
    with pytest.raises(TypeError, match=r"tf_keras \(Keras 2\) models"):
        _models.check_model(tf_keras_like(), "caller")
    with pytest.raises(TypeError, match="subclassed Subclassed.*Do this"):
        _models.check_graph_model(Subclassed(), "caller", "Do this.")
    _models.check_graph_model(_nested(), "caller", "unused")


def test_reset_compiled_functions_retraces_train_and_drops_the_others():
    model = keras.Sequential([keras.Input((4,)), L.Dense(2)])
    model.compile("sgd", "mse")
    x = keras.ops.ones((4, 4))
    model.fit(x, x[:, :2], verbose=0)
    model.predict(x, verbose=0)
    train = model.train_function
    _models.reset_compiled_functions(model)
    assert model.predict_function is None
    assert (
        model.train_function is not None and model.train_function is not train
    )


def test_keras_checks_pass_on_this_keras():
    _keras.check_versions()
    assert _keras.is_graph_model(_nested())
    assert not _keras.is_graph_model(Subclassed())

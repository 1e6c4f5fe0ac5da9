import keras
import numpy as np
import pytest

import keras_mp
from keras_mp._models import walk_layers
from keras_mp.mixed_precision import policy
from tests.conftest import Subclassed, small_cnn, tf_keras_like
from tests.quantization.test_nested import Block, Net


def test_enable_returns_previous_and_restores_as_context():
    previous = keras_mp.enable_mixed_precision("mixed_float16")
    assert previous == "float32"
    assert keras.mixed_precision.global_policy().name == "mixed_float16"
    with keras_mp.enable_mixed_precision("mixed_bfloat16") as prev:
        assert prev == "mixed_float16"
        assert keras.mixed_precision.global_policy().name == "mixed_bfloat16"
    assert keras.mixed_precision.global_policy().name == "mixed_float16"


@pytest.fixture
def machine(monkeypatch):
    """Stubs the device query of "auto": `machine(gpus, cpu_flags)`."""

    def stub(gpus=(), flags=()):
        monkeypatch.setattr(
            policy, "_gpu_compute_capabilities", lambda: list(gpus)
        )
        monkeypatch.setattr(policy, "_cpu_flags", lambda: set(flags))

    return stub


@pytest.mark.parametrize(
    "gpus, expected, says",
    [
        ([(8, 0)], "mixed_bfloat16", "8.0 >= 8.0"),
        ([(9, 0)], "mixed_bfloat16", "9.0 >= 8.0"),
        ([(7, 0)], "mixed_float16", "7.0 has float16"),
        ([(7, 5)], "mixed_float16", "7.5 has float16"),
        ([(6, 1)], "float32", "6.1 < 7.0"),
        ([(8, 6), (7, 5)], "mixed_float16", "7.5"),  # the weakest GPU
        ([(9, 0), (6, 1), (8, 0)], "float32", "6.1"),
    ],
)
def test_auto_follows_the_gpu_compute_capability(machine, gpus, expected, says):
    # CPU flags must not matter once there is a GPU.
    machine(gpus, flags={"amx_bf16"} if expected == "float32" else ())
    previous = keras_mp.enable_mixed_precision("auto")
    assert keras.mixed_precision.global_policy().name == expected
    assert says in previous.reason and previous == "float32"


@pytest.mark.parametrize(
    "flags, expected, says",
    [
        ({"avx2", "amx_bf16"}, "mixed_bfloat16", "(amx_bf16)"),
        ({"avx512f", "avx512_bf16"}, "mixed_bfloat16", "(avx512_bf16)"),
        ({"avx2", "avx512f", "fma"}, "float32", "emulated"),
        (set(), "float32", "emulated"),
    ],
)
def test_auto_without_gpu_follows_the_cpu_flags(machine, flags, expected, says):
    machine(gpus=(), flags=flags)
    assert policy.resolve_auto_policy()[0] == expected
    previous = keras_mp.enable_mixed_precision("auto")
    assert keras.mixed_precision.global_policy().name == expected
    assert says in previous.reason


@pytest.mark.parametrize(
    "bad, received",
    [
        ("float16", "'float16'"),
        ("fp16", "'fp16'"),
        (None, "None"),
        (16, "16"),
    ],
)
def test_unknown_policy_is_rejected_with_the_choices(bad, received):
    with pytest.raises(
        ValueError,
        match=r"Unknown mixed-precision policy. Expected one of "
        r"\('mixed_float16', 'mixed_bfloat16', 'float32', 'auto'\). "
        rf"Received: policy={received}$",
    ):
        keras_mp.enable_mixed_precision(bad)


def _functional_with_softmax():
    inputs = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(8, 3)(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(12)(x)
    x = keras.layers.LayerNormalization()(x)
    outputs = keras.layers.Dense(5, activation="softmax")(x)
    return keras.Model(inputs, outputs)


@pytest.mark.parametrize("name", ["mixed_float16", "mixed_bfloat16"])
def test_apply_keeps_sensitive_layers_float32(name):
    model = _functional_with_softmax()
    mixed = keras_mp.apply_mixed_precision(model, name)
    half = {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}[name]
    for layer in mixed.layers[1:]:
        sensitive = (
            isinstance(
                layer,
                (
                    keras.layers.BatchNormalization,
                    keras.layers.LayerNormalization,
                ),
            )
            or layer is mixed.layers[-1]
        )
        want = "float32" if sensitive else half
        assert layer.compute_dtype == want, layer.name
        assert layer.variable_dtype == "float32"
    x = np.random.rand(4, 16, 16, 3).astype("float32")
    out = mixed(x)
    assert keras.backend.standardize_dtype(out.dtype) == "float32"
    np.testing.assert_allclose(out, model(x), atol=2e-2)


def test_softmax_activation_inside_the_model_stays_float32():
    inputs = keras.Input((8,))
    x = keras.layers.Dense(8, activation="log_softmax")(inputs)
    x = keras.layers.Activation("softmax")(x)
    x = keras.layers.Dense(8, activation="relu")(x)
    outputs = keras.layers.Dense(4)(x)
    mixed = keras_mp.apply_mixed_precision(
        keras.Model(inputs, outputs), "mixed_float16"
    )
    dtypes = [layer.compute_dtype for layer in mixed.layers[1:]]
    assert dtypes == ["float32", "float32", "float16", "float32"]


def test_softmax_layer_and_output_are_sensitive():
    model = _functional_with_softmax()
    assert keras_mp.is_precision_sensitive(model.layers[-1], model)
    assert keras_mp.is_precision_sensitive(keras.layers.Softmax())
    assert not keras_mp.is_precision_sensitive(model.layers[1], model)
    assert not keras_mp.is_precision_sensitive(model.layers[-3], model)


def test_apply_rejects_what_it_cannot_copy():
    with pytest.raises(TypeError, match=r"Keras 3 `keras.Model`. Received"):
        keras_mp.apply_mixed_precision(object())
    with pytest.raises(
        TypeError, match=r"tf_keras \(Keras 2\) models are not supported"
    ):
        keras_mp.apply_mixed_precision(tf_keras_like())
    with pytest.raises(
        TypeError,
        match=r"copies Subclassed 'subclassed' under the new policy through "
        r"its config, and that failed.*`get_config\(\)`"
        r".*enable_mixed_precision",
    ):
        keras_mp.apply_mixed_precision(Subclassed())
    net = Net(name="net")
    net(np.ones((1, 6), "float32"))
    with pytest.raises(
        TypeError,
        match=r"could not give any layer of model 'net' the policy "
        r"'mixed_float16'.*Net's code.*enable_mixed_precision\(\)",
    ):
        keras_mp.apply_mixed_precision(net, "mixed_float16")
    with pytest.raises(
        ValueError,
        match=r"`policy` must be one of \('mixed_float16', 'mixed_bfloat16', "
        r"'float32'\). Received: policy='float16'",
    ):
        keras_mp.apply_mixed_precision(small_cnn(), "float16")


def test_set_tf32_returns_previous_state():
    previous = keras_mp.set_tf32(False)
    assert keras_mp.set_tf32(previous) is False
    assert keras_mp.set_tf32(previous) is previous


def _round_trip(model, tmp_path, data):
    """Saves and loads with safe_mode=True: same dtypes, same outputs."""
    path = tmp_path / "mixed.keras"
    model.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    assert [x.compute_dtype for x in walk_layers(loaded)] == [
        x.compute_dtype for x in walk_layers(model)
    ]
    for a, b in zip(
        keras.tree.flatten(model(data)),
        keras.tree.flatten(loaded(data)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_keras_hub_bert_backbone_takes_the_policy(tmp_path):
    """Every Dense/EinsumDense inside BERT's custom layers computes in
    bfloat16 (the policy goes down as a DTypePolicyMap), the graph's own
    LayerNorm and the pooled output stay float32, the softmax inside the
    attention is named as left in bfloat16; the policies are saved."""
    keras_hub = pytest.importorskip("keras_hub")
    model = keras_hub.models.BertBackbone(
        vocabulary_size=50,
        num_layers=1,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=8,
    )
    with pytest.warns(UserWarning, match="bfloat16 although.*softmax"):
        mixed = keras_mp.apply_mixed_precision(model, "mixed_bfloat16")
    dtypes = {x.path: x.compute_dtype for x in walk_layers(mixed) if x.path}
    weighted = [
        x.path
        for x in walk_layers(mixed)
        if isinstance(x, (keras.layers.Dense, keras.layers.EinsumDense))
    ]
    assert len(weighted) == 7
    assert {dtypes[p] for p in weighted if p != "pooled_dense"} == {"bfloat16"}
    assert (
        dtypes["pooled_dense"] == dtypes["embeddings_layer_norm"] == "float32"
    )
    data = {
        "token_ids": np.arange(16, dtype="int32").reshape(2, 8) % 50,
        "segment_ids": np.zeros((2, 8), "int32"),
        "padding_mask": np.ones((2, 8), "int32"),
    }
    np.testing.assert_allclose(
        mixed(data)["pooled_output"],
        model(data)["pooled_output"],
        atol=5e-2,
    )
    _round_trip(mixed, tmp_path, data)


def test_custom_layer_that_does_not_pass_dtype_is_named(tmp_path):
    inputs = keras.Input((6,))
    x = keras.layers.Dense(8, name="stem")(inputs)
    x = Block(8, name="block")(x)
    model = keras.Model(inputs, keras.layers.Dense(3, name="head")(x))
    with pytest.warns(UserWarning, match=r"stay float32.*: dense"):
        mixed = keras_mp.apply_mixed_precision(model, "mixed_float16")
    assert mixed.get_layer("stem").compute_dtype == "float16"
    assert mixed.get_layer("block").compute_dtype == "float32"
    _round_trip(mixed, tmp_path, np.ones((2, 6), "float32"))


@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.layers.Bidirectional(keras.layers.LSTM(6)),
        lambda: keras.layers.Bidirectional(
            keras.layers.GRU(6),
            backward_layer=keras.layers.GRU(6, go_backwards=True),
        ),
        lambda: keras.layers.TimeDistributed(keras.layers.Dense(4)),
    ],
    ids=["bidirectional", "backward_layer", "time_distributed"],
)
def test_wrapped_layers_take_the_policy(make, tmp_path):
    # Bidirectional and TimeDistributed build their sublayers from the
    # wrapped layer's config: its dtype, not theirs, reached them.
    model = keras.Sequential(
        [
            keras.Input((5, 4)),
            make(),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )
    x = np.random.default_rng(0).random((8, 5, 4), dtype=np.float32)
    mixed = keras_mp.apply_mixed_precision(model, "mixed_bfloat16")
    wrapper = mixed.layers[0]
    inner = [x for x in walk_layers(wrapper) if x is not wrapper]
    assert inner and all(x.compute_dtype == "bfloat16" for x in inner)
    assert mixed.layers[-1].compute_dtype == "float32"  # the output layer
    np.testing.assert_allclose(mixed(x), model(x), atol=0.05)
    mixed.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    np.testing.assert_array_equal(loaded(x), mixed(x))

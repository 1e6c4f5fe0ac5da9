"""Quantization in place: layers inside custom layers, subclassed models,
keras-hub backbones and MultiHeadAttention, with `.keras` round trips."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp
from keras_mp import _models
from keras_mp.quantization import twins

L = keras.layers
PACKAGE = "keras_mp_tests"


@keras.saving.register_keras_serializable(package=PACKAGE)
class Block(L.Layer):
    """Dense -> LayerNorm + residual, its sublayers made in `__init__`."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.fc = L.Dense(units)
        self.norm = L.LayerNormalization()

    def build(self, shape):
        self.fc.build(shape)
        self.norm.build((*shape[:-1], self.units))

    def call(self, x):
        return self.norm(self.fc(x)) + x

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@keras.saving.register_keras_serializable(package=PACKAGE)
class Net(keras.Model):
    """A subclassed model holding a custom layer."""

    def __init__(self, units=8, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.stem = L.Dense(units)
        self.block = Block(units)
        self.head = L.Dense(3)

    def call(self, x):
        return self.head(self.block(self.stem(x)))

    def get_config(self):
        return {"units": self.units, "name": self.name}


class NoConfig(keras.Model):
    """Subclassed, constructor without `**kwargs`: no from_config."""

    def __init__(self):
        super().__init__(name="no_config")
        self.fc = L.Dense(3)

    def call(self, x):
        return self.fc(x)


@keras.saving.register_keras_serializable(package=PACKAGE)
class Twice(L.Layer):
    """Calls one Dense twice (shared weights)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.fc = L.Dense(6)

    def build(self, shape):
        self.fc.build((*shape[:-1], 6))

    def call(self, x):
        return self.fc(self.fc(x))


@keras.saving.register_keras_serializable(package=PACKAGE)
class OwnMatmul(L.Layer):
    """A weight of its own and a matmul no table row knows."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], 6), name="w")

    def call(self, x):
        return keras.ops.matmul(x, self.w)


def _x(n=32, shape=(6,), seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, *shape)).astype("float32")


def _block_model():
    inputs = keras.Input((6,))
    x = L.Dense(8, name="stem")(inputs)
    x = Block(8, name="block")(x)
    return keras.Model(inputs, L.Dense(3, name="head")(x), name="nested")


def _net():
    model = Net(name="net")
    model(_x(1))
    return model


def _round_trip(model, tmp_path, data):
    path = tmp_path / "q.keras"
    model.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    assert isinstance(loaded, keras_mp.RecordedModel)
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(loaded(data)),
        keras.ops.convert_to_numpy(model(data)),
    )
    return loaded


@pytest.mark.parametrize("make", [_block_model, _net], ids=["nested", "sub"])
def test_layers_inside_custom_layers_are_quantized(make, tmp_path):
    model, x = make(), _x()
    qmodel = keras_mp.quantize_model(model)
    assert isinstance(qmodel, keras_mp.RecordedModel)
    block = next(
        layer
        for layer in keras_mp._models.walk_layers(qmodel)
        if isinstance(layer, Block)
    )
    inner = twins.quantized_layers(block)
    assert len(inner) == 1 and inner[0].float_class is L.Dense
    assert not twins.quantized_layers(model)  # the float model is intact
    report = keras_mp.calibrate(qmodel, x, verbose=0)
    assert len(report.ranges) == 3 and all(
        a > 0 for a in report.ranges.values()
    )
    want, got = model(x), qmodel(x)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert 0 < rel < 0.05, rel
    rows = keras_mp.quantization_report(qmodel, verbose=False).rows
    quantized = [r["path"] for r in rows if r["quantized"]]
    assert any(p.endswith(f"{block.name}/{inner[0].name}") for p in quantized)
    qmodel.compile(keras.optimizers.SGD(1e-2), "mse", jit_compile=True)
    history = qmodel.fit(x, np.zeros((32, 3)), epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    _round_trip(qmodel, tmp_path, x)
    stripped = keras_mp.strip_quantization(qmodel)
    assert type(stripped) is type(model)
    assert not twins.quantized_layers(stripped)
    keras_mp.set_quantization_enabled(qmodel, False)
    np.testing.assert_array_equal(stripped(x), qmodel(x))


def test_weights_file_loads_into_a_model_quantized_again(tmp_path):
    x = _x()
    qmodel = keras_mp.quantize_model(_net())
    keras_mp.calibrate(qmodel, x, verbose=0)
    qmodel.save_weights(tmp_path / "w.weights.h5")
    other = keras_mp.quantize_model(_net())
    other.load_weights(tmp_path / "w.weights.h5")
    np.testing.assert_array_equal(other(x), qmodel(x))


def test_model_without_config_quantizes_in_place_and_fails_at_save(
    tmp_path,
):
    model = NoConfig()
    x = _x()
    model(x)
    with pytest.raises(ValueError, match="rebuilt from its config.*in_place"):
        keras_mp.quantize_model(model)
    with pytest.warns(
        UserWarning, match="cannot be saved with its keras_mp state"
    ):
        qmodel = keras_mp.quantize_model(model, in_place=True)
    assert qmodel.model is model and twins.is_quantized(model.fc)
    keras_mp.calibrate(qmodel, x, verbose=0)
    path = tmp_path / "q.keras"
    with pytest.raises(
        ValueError, match="cannot be saved with its keras_mp state.*"
    ):
        qmodel.save(path)
    assert not path.exists()
    path.write_bytes(b"previous")  # an earlier file stays as it was
    with pytest.raises(
        ValueError, match="cannot be saved with its keras_mp state.*"
    ):
        qmodel.save(path)
    assert path.read_bytes() == b"previous"
    assert os.listdir(tmp_path) == ["q.keras"]
    qmodel.save_weights(tmp_path / "w.weights.h5")  # the way that works


def test_recipe_needs_the_same_model():
    qmodel = keras_mp.quantize_model(_net())
    config = qmodel.get_config()
    config["model"] = keras.saving.serialize_keras_object(_block_model())
    with pytest.raises(ValueError, match="does not have the layers its rec"):
        keras_mp.RecordedModel.from_config(config)


def test_quantizing_a_quantized_model_is_rejected():
    qmodel = keras_mp.quantize_model(_net())
    for model in (qmodel, qmodel.model):
        with pytest.raises(ValueError, match="already quantized"):
            keras_mp.quantize_model(model)


def test_shared_sublayer_warns_and_a_custom_matmul_is_reached():
    inputs = keras.Input((6,))
    x = Twice(name="twice")(inputs)
    x = OwnMatmul(name="own")(x)
    model = keras.Model(inputs, L.Dense(2)(x))
    with pytest.warns(UserWarning, match="called more than once.*one scale"):
        qmodel = keras_mp.quantize_model(model)
    keras_mp.calibrate(qmodel, _x(), verbose=0)
    notes = {
        r["layer"]: r["note"]
        for r in keras_mp.quantization_report(qmodel, verbose=False).rows
    }
    # its own matmul is quantized where it is called (op_sites)
    assert notes["own"] == ""
    assert notes["twice"].startswith("holds layers")


def test_config_and_selection_by_container_name():
    qmodel = keras_mp.quantize_model(
        _block_model(),
        layers="block",
        config={
            "block": keras_mp.QuantizeConfig(precision="int4", block_size=None)
        },
    )
    (layer,) = twins.quantized_layers(qmodel)
    assert layer.quantize_path == "block/" + layer.name
    assert layer.quantize_config.num_bits == 4


def _mha_block(heads=2):
    inputs = keras.Input((8, 16))
    x = L.Dense(16, name="proj")(inputs)
    n = L.LayerNormalization(name="ln")(x)
    x = L.Add(name="res")([x, L.MultiHeadAttention(heads, 8, name="mha")(n, n)])
    x = L.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, L.Dense(3, name="head")(x), name="mha_block")


def test_attention_gets_projection_and_matmul_quantizers(tmp_path):
    model, x = _mha_block(), _x(shape=(8, 16))
    qmodel = keras_mp.quantize_model(model)
    mha = qmodel.model.get_layer("mha")
    # the attention at its op site: Keras' `ops.dot_product_attention`
    assert sorted(mha.named_quantizers()) == [
        "dot_product_attention_0/key",
        "dot_product_attention_0/probs",
        "dot_product_attention_0/query",
        "dot_product_attention_0/value",
    ]
    # each projection quantizes its own input, as any EinsumDense does
    for projection in (mha.query_dense, mha.key_dense, mha.value_dense):
        assert projection.input_indices == [0]
        assert projection.weight_quantizers
    assert mha.output_dense.input_indices == [0]
    # the residual Add: Q/DQ on the stream `proj` (it also feeds the
    # LayerNorm), the attention output GEMM fuses with the Add
    assert qmodel.model.get_layer("res").input_indices == [0]
    keras_mp.calibrate(qmodel, x, verbose=0)
    # one tensor, one range: the three inputs are the LayerNorm's output
    ranges = {
        float(p.input_quantizers[0].amax.numpy())
        for p in (mha.query_dense, mha.key_dense, mha.value_dense)
    }
    assert len(ranges) == 1
    want, got = model(x), qmodel(x)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert 0 < rel < 0.05, rel
    # ... and in the export one Q/DQ feeds the three projections
    path = str(tmp_path / "mha.onnx")
    keras_mp.export_onnx(qmodel, path, verify_data=x)
    import onnx

    from keras_mp.onnx.graph import GraphIndex

    graph = GraphIndex(onnx.load(path))
    projections = [
        n
        for n in graph.nodes
        if n.op_type == "MatMul"
        and any(f"/{p}_1/" in n.name for p in ("query", "key", "value"))
    ]
    sources = set()
    for node in projections:
        dq = graph.producers[node.input[0]]  # the activation operand
        assert dq.op_type == "DequantizeLinear", graph.name(node)
        sources.add(graph.producers[dq.input[0]].output[0])  # one Q
    assert len(projections) == 3 and len(sources) == 1, sources
    assert _fused_attention_chains(path) == [True]
    _round_trip(qmodel, tmp_path, x)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(qmodel(x, training=True) ** 2)
    grads = tape.gradient(loss, qmodel.trainable_variables)
    assert all(g is not None and np.any(g.numpy() != 0) for g in grads)
    qmodel.compile(keras.optimizers.Adam(1e-3), "mse", jit_compile=True)
    history = qmodel.fit(x, np.zeros((32, 3)), epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_attention_matmuls_can_stay_float(tmp_path):
    model, x = _mha_block(), _x(shape=(8, 16))
    qmodel = keras_mp.quantize_model(
        model, config=keras_mp.QuantizeConfig(attention=False)
    )
    mha = qmodel.model.get_layer("mha")
    assert not twins.is_quantized(mha)
    assert mha.query_dense.input_indices == [0]
    keras_mp.calibrate(qmodel, x, verbose=0)
    path = str(tmp_path / "mha.onnx")
    keras_mp.export_onnx(qmodel, path, verify_data=x)
    lint = keras_mp.check_tensorrt(path)
    assert lint.ok, lint.to_markdown()
    # the two attention matmuls in float, every projection in INT8
    assert (lint.weighted_ops, lint.weighted_ops_quantized) == (8, 6)
    assert _fused_attention_chains(path) == [False]


def test_cross_attention_call_after_self_attention_quantization():
    # Quantized as self-attention, called as cross-attention: the
    # projections quantize their own inputs, so nothing is shared that
    # the new call would break.
    inputs = keras.Input((4, 8))
    mha = L.MultiHeadAttention(2, 4, name="mha")
    model = keras.Model(inputs, mha(inputs, inputs))
    x = _x(16, (4, 8))
    want = keras.ops.convert_to_numpy(mha(x, x + 1.0))
    qmodel = keras_mp.quantize_model(model)
    keras_mp.calibrate(qmodel, [x, x + 1.0], verbose=0)
    layer = qmodel.model.get_layer("mha")
    got = keras.ops.convert_to_numpy(layer(x, x + 1.0))
    assert 0 < np.linalg.norm(got - want) / np.linalg.norm(want) < 0.05


def _fused_attention_chains(path):
    """Per Softmax: whether TensorRT's fused-attention pattern holds,
    `DQ -> MatMul <- DQ -> ... -> Softmax -> ... -> Q/DQ -> MatMul <- DQ`,
    with no scale multiply (a Mul by a constant) after the first MatMul:
    between the matmuls only masking (Mul/Add by the mask, Where, Cast)
    and layout ops."""
    import onnx

    from keras_mp.onnx.graph import LAYOUT_OPS, GraphIndex

    graph = GraphIndex(onnx.load(path))
    masking = {"Mul", "Add", "Where", "Cast", "Not", "Sub"} | LAYOUT_OPS

    def scale(node):
        return node.op_type in ("Mul", "Div") and any(
            (c := graph.const(t)) is not None and c.size == 1
            for t in node.input
        )

    def first_matmul(tensor, depth=0):
        node = graph.producers.get(tensor)
        if node is None or depth > 6 or scale(node):
            return None
        if node.op_type == "MatMul":
            return node
        if node.op_type not in masking:
            return None
        found = [first_matmul(t, depth + 1) for t in node.input]
        return next((f for f in found if f is not None), None)

    chains = []
    for softmax in (n for n in graph.nodes if n.op_type == "Softmax"):
        first = first_matmul(softmax.input[0])
        out, seen, second = softmax.output[0], [], None
        for _ in range(8):
            if not graph.consumers.get(out):
                break  # a classifier's softmax: the graph output
            (consumer, _), *_ = graph.consumers[out]
            if consumer.op_type == "MatMul":
                second = consumer
                break
            seen.append(consumer.op_type)
            out = consumer.output[0]
        chains.append(
            first is not None
            and all(graph.quantized_inputs(first))
            and "QuantizeLinear" in seen
            and set(seen) <= masking | {"QuantizeLinear", "DequantizeLinear"}
            and second is not None
            and all(graph.quantized_inputs(second))
        )
    return chains


def test_attention_export_is_lint_clean_with_fused_pattern(tmp_path):
    qmodel, x = keras_mp.quantize_model(_mha_block()), _x(shape=(8, 16))
    keras_mp.calibrate(qmodel, x, verbose=0)
    path = str(tmp_path / "mha.onnx")
    keras_mp.export_onnx(qmodel, path, verify_data=x)
    lint = keras_mp.check_tensorrt(path)
    assert lint.ok, lint.to_markdown()
    # proj, Q, K, V, both attention matmuls, output projection, head
    assert lint.weighted_ops == lint.weighted_ops_quantized == 8
    assert _fused_attention_chains(path) == [True]


def test_qat_under_mirrored_strategy(mirrored_strategy):
    x = _x()
    with mirrored_strategy.scope():
        qmodel = keras_mp.quantize_model(_block_model())
        qmodel.compile(keras.optimizers.SGD(1e-2), "mse")
    keras_mp.calibrate(qmodel, x, verbose=0)
    before = {n: float(q.amax.numpy()) for n, q in _quantizers(qmodel).items()}
    history = qmodel.fit(x, np.zeros((32, 3)), epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    after = {n: float(q.amax.numpy()) for n, q in _quantizers(qmodel).items()}
    assert after == before  # calibrated ranges stay frozen in QAT


_quantizers = keras_mp.quantization.activation_quantizers


class _Interrupt(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("interrupted")


@pytest.mark.slow  # three quantize + fit runs
@pytest.mark.parametrize("precision", ["int8", "float8"])
def test_backup_and_restore_resumes_qat_bit_for_bit(tmp_path, precision):
    x, y = _x(), np.zeros((32, 3))

    def quantized():
        keras.utils.set_random_seed(0)
        qmodel = keras_mp.quantize_model(_block_model(), precision=precision)
        keras_mp.calibrate(qmodel, x, verbose=0)
        qmodel.compile(keras.optimizers.Adam(1e-3), "mse")
        return qmodel

    reference = quantized()
    reference.fit(x, y, epochs=4, shuffle=False, verbose=0)
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(RuntimeError, match="interrupted"):
        quantized().fit(
            x,
            y,
            epochs=4,
            shuffle=False,
            verbose=0,
            callbacks=[backup, _Interrupt()],
        )
    resumed = quantized()
    resumed.fit(x, y, epochs=4, shuffle=False, verbose=0, callbacks=[backup])
    for a, b in zip(reference.weights, resumed.weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


@keras.saving.register_keras_serializable(package=PACKAGE)
class Annotated(keras.Model):
    """Marks one of its layers while building."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.fc = keras_mp.quantize_annotate_layer(L.Dense(4))
        self.head = L.Dense(2)

    def call(self, x):
        return self.head(self.fc(x))


def test_annotate_then_apply_in_place(tmp_path):
    x = _x()
    annotated = keras_mp.quantize_annotate_model(_net(), layers="block.*")
    assert not twins.quantized_layers(annotated)
    qmodel = keras_mp.quantize_apply(annotated)
    (layer,) = twins.quantized_layers(qmodel)
    assert "block" in layer.quantize_path
    model = Annotated(name="annotated")
    model(x)
    qmodel = keras_mp.quantize_apply(model)
    (layer,) = twins.quantized_layers(qmodel)
    assert layer.units == 4  # only the annotated Dense
    keras_mp.calibrate(qmodel, x, verbose=0)
    _round_trip(qmodel, tmp_path, x)


@keras.saving.register_keras_serializable(package=PACKAGE)
class Picky(keras.Model):
    """Self-attention in a model that refuses all-zero data."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = L.MultiHeadAttention(2, 4)

    def call(self, x):
        if tf.executing_eagerly() and not np.any(x):
            raise ValueError("needs real data")
        return self.attention(x, x)


def test_attention_without_probe_keeps_its_matmuls_float():
    model = Picky(name="picky")
    x = _x(4, (5, 8))
    model(x)
    with pytest.warns(UserWarning, match="Could not run model 'picky'"):
        qmodel = keras_mp.quantize_model(model)
    (attention,) = [
        layer
        for layer in _models.walk_layers(qmodel)
        if isinstance(layer, L.MultiHeadAttention)
    ]
    # its own ops were not seen: float, as the warning says; the
    # projections are layers of the table, quantized
    assert not twins.is_quantized(attention)
    assert attention.query_dense.input_indices == [0]
    report = keras_mp.calibrate(qmodel, x, verbose=0)
    assert all(amax > 0 for amax in report.ranges.values())  # none unused


@keras.saving.register_keras_serializable("keras_mp_tests")
class _FusionStage(L.Layer):
    """DepthAnything's fusion stage: `spare` is built, but only called
    with a residual, which the first stage never gets."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.used = L.Dense(8, name="used")
        self.spare = L.Dense(8, name="spare")

    def build(self, shape):
        self.used.build(shape)
        self.spare.build(shape)

    def call(self, x, residual=None):
        if residual is not None:
            x = x + self.spare(residual)
        return self.used(x)


def test_a_layer_the_model_never_calls_stays_float(tmp_path):
    inputs = keras.Input((8,))
    model = keras.Model(inputs, L.Dense(2)(_FusionStage()(inputs)))
    x = np.random.default_rng(0).random((16, 8), dtype=np.float32)
    with pytest.warns(UserWarning, match="did not call.*: spare"):
        qmodel = keras_mp.quantize_model(model)
    keras_mp.calibrate(qmodel, x, verbose=0)
    report = keras_mp.quantization_report(qmodel).rows
    quantized = {r["layer"]: r["quantized"] for r in report}
    assert quantized["used"] and not quantized["spare"]
    # nothing uncalibrated left: the export (which refuses a range of 0)
    # goes through
    parity = keras_mp.export_onnx(qmodel, tmp_path / "q.onnx", verify_data=x)
    assert parity.rel_l2 < 1e-4


@keras.saving.register_keras_serializable(package=PACKAGE)
class FrameMatmul(OwnMatmul):
    def compute_output_shape(self, shape):
        return (*shape[:-1], 6)


def test_layers_inside_time_distributed_are_reached(tmp_path):
    # TimeDistributed calls its inner layer's `call` once per time step,
    # never its `__call__`: the only convolution of this model is there.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 12, 12, 3))
    x = L.TimeDistributed(
        L.Conv2D(16, 3, activation="relu", name="conv"), name="td"
    )(inputs)
    x = L.TimeDistributed(L.GlobalAveragePooling2D())(x)
    x = L.TimeDistributed(FrameMatmul(name="own"), name="td_own")(x)
    model = keras.Model(inputs, L.Dense(4)(L.GlobalAveragePooling1D()(x)))
    data = np.random.default_rng(0).random((8, 4, 12, 12, 3), np.float32)
    qmodel = keras_mp.quantize_model(model)
    keras_mp.calibrate(qmodel, data, verbose=0)
    rows = {
        r["path"]: r for r in keras_mp.quantization_report(qmodel, False).rows
    }
    assert rows["td/conv"]["quantized"] or any(
        p.startswith("td/") and r["quantized"] for p, r in rows.items()
    )
    assert any(
        p.startswith("td_own/") and r["quantized"] for p, r in rows.items()
    )
    path = str(tmp_path / "td.onnx")
    keras_mp.export_onnx(qmodel, path, verify_data=data)  # ParityError
    assert keras_mp.check_tensorrt(path).ok
    report = keras_mp.compare_onnx(qmodel, path, data[:4])
    assert report.first_divergence is None, str(report)

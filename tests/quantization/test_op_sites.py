"""Op-level quantization: the GEMMs inside a layer's own code (`op_sites`).

Layers nobody wrote a twin for: a hand-written attention (`ops.matmul` on
its own weights, `@` on a transposed key, a softmax), a layer calling
`ops.dot_product_attention` with a causal mask, a mixture of experts
(`ops.einsum` with an expert axis), and keras-hub's tied-embedding output
(`ReversibleEmbedding(reverse=True)`: `ops.matmul` on the transposed
embedding table).
"""

import os

import keras
import numpy as np
import onnx
import pytest
from keras import ops

import keras_mp
from keras_mp.quantization import op_sites, twins

pytest.importorskip("tf2onnx")


from benchmarks.op_site_models import LAYERS, HandAttention
from benchmarks.op_site_models import layer_model as _model
from benchmarks.op_site_models import sequences as _data

# The quantizers each layer's code gets: every GEMM operand but a shared
# input's second use (one tensor, one Q/DQ) and the integer-free gate.
EXPECTED = {
    "hand": {
        "matmul_0/operand_0",  # x, shared by the q, k, v projections
        "matmul_0/operand_1",
        "matmul_1/operand_1",
        "matmul_2/operand_1",
        "matmul_3/operand_0",  # q
        "matmul_3/operand_1",  # k transposed
        "matmul_4/operand_0",  # the softmax output
        "matmul_4/operand_1",  # v
        "matmul_5/operand_0",
        "matmul_5/operand_1",
    },
    "fused": {
        "einsum_0/operand_0",
        "einsum_0/operand_1",
        "dot_product_attention_1/query",
        "dot_product_attention_1/key",
        "dot_product_attention_1/value",
        "dot_product_attention_1/probs",
        "einsum_2/operand_0",
        "einsum_2/operand_1",
    },
    "experts": {
        "router/input_0",  # the router Dense: a table row of its own
        "router/kernel",
        "einsum_0/operand_0",
        "einsum_0/operand_1",
        "einsum_1/operand_0",
        "einsum_1/operand_1",
        "einsum_2/operand_0",
        "einsum_2/operand_1",
    },
}


@pytest.fixture(scope="module", params=list(LAYERS))
def quantized(request):
    kind = request.param
    model = _model(kind)
    qmodel = keras_mp.quantize_model(model)
    keras_mp.calibrate(qmodel, _data(), verbose=0)
    return kind, model, qmodel


def test_every_gemm_operand_gets_a_quantizer(quantized):
    kind, _, qmodel = quantized
    names = {
        q.name.split("/", 1)[1]
        for q in twins.quantizers(qmodel)
        if q.name.startswith(f"{kind}/")
    }
    assert names == EXPECTED[kind]
    report = {r["layer"]: r for r in keras_mp.quantization_report(qmodel).rows}
    assert report[kind]["quantized"]


def test_weight_operands_are_per_output_channel(quantized):
    kind, _, qmodel = quantized
    weights = {
        q.name.split("/", 1)[1]: q.quantizer
        for q in twins.quantizers(qmodel)
        if q.weight is not None
    }
    if kind == "hand":  # (in, out): one range per output column
        assert weights["matmul_0/operand_1"].amax.shape == (32,)
    if kind == "experts":
        # (e, d, f) in "btd,edf->btef": per expert and output channel
        assert weights["einsum_0/operand_1"].out_axes == (0, 2)
        # (e, f, d) in "btef,efd->bted", e a batch axis: per d (ONNX
        # scales vary along one axis of a batched MatMul's weight)
        assert weights["einsum_1/operand_1"].out_axes == (2,)
    for q in weights.values():
        assert q.narrow_range and np.all(q.amax.numpy() > 0)


def test_quantization_off_is_the_float_model_exactly(quantized):
    _, model, qmodel = quantized
    x = _data()
    assert not np.array_equal(qmodel(x), model(x))
    keras_mp.set_quantization_enabled(qmodel, False)
    try:
        np.testing.assert_array_equal(qmodel(x), model(x))
    finally:
        keras_mp.set_quantization_enabled(qmodel, True)


def test_saved_and_traced_compute_the_same(quantized, tmp_path):
    _, _, qmodel = quantized
    x = _data()
    path = str(tmp_path / "q.keras")
    qmodel.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    np.testing.assert_array_equal(loaded(x), qmodel(x))
    np.testing.assert_array_equal(qmodel.predict(x, verbose=0), qmodel(x))


def test_export_puts_every_gemm_behind_qdq(quantized, tmp_path):
    kind, _, qmodel = quantized
    path = str(tmp_path / f"{kind}.onnx")
    report = keras_mp.export_onnx(qmodel, path, verify_data=_data())
    assert report.rel_l2 < 1e-5, report
    lint = keras_mp.check_tensorrt(path)
    assert lint.ok, str(lint)
    graph = onnx.load(path).graph
    producers = {o: n for n in graph.node for o in n.output}
    gemms = [n for n in graph.node if n.op_type == "MatMul"]
    covered = [
        n
        for n in gemms
        if all(
            producers.get(i) is not None
            and producers[i].op_type == "DequantizeLinear"
            for i in n.input[:2]
        )
    ]
    # the 4-class head (K=32, N=4) stays float by the small-GEMM rule only
    # when it is on; conftest turns it off for tiny layers
    assert len(covered) >= len(gemms) - 1, [n.name for n in gemms]
    os.remove(path)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"is_causal": True},
        {"mask": True},
        {"bias": True, "scale": 0.3},
    ],
)
def test_attention_without_quantizers_is_keras_attention(kwargs):
    rng = np.random.default_rng(1)
    q = rng.normal(size=(2, 5, 4, 8)).astype("float32")
    k = rng.normal(size=(2, 5, 2, 8)).astype("float32")  # grouped heads
    v = rng.normal(size=(2, 5, 2, 8)).astype("float32")
    if kwargs.get("mask"):
        kwargs["mask"] = rng.random((2, 1, 5, 5)) > 0.3
    if kwargs.get("bias"):
        kwargs["bias"] = rng.normal(size=(2, 4, 5, 5)).astype("float32")
    op = op_sites.original("dot_product_attention")
    want = op(q, k, v, **kwargs)
    got = op_sites.quantized_attention(op, (q, k, v), kwargs, {})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_tied_embedding_output_matmul_is_quantized(tmp_path):
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    tokens = keras.Input((6,), dtype="int32")
    embedding = keras_hub.layers.ReversibleEmbedding(64, 32, name="embed")
    x = keras.layers.Dense(32, name="mix")(embedding(tokens))
    model = keras.Model(tokens, embedding(x, reverse=True))
    data = np.random.default_rng(0).integers(0, 64, (16, 6)).astype("int32")
    qmodel = keras_mp.quantize_model(model)
    keras_mp.calibrate(qmodel, data, verbose=0)
    names = {q.name for q in twins.quantizers(qmodel)}
    assert {"embed/matmul_0/operand_0", "embed/matmul_0/operand_1"} <= names
    path = str(tmp_path / "tied.onnx")
    keras_mp.export_onnx(qmodel, path, verify_data=data)
    assert keras_mp.check_tensorrt(path).ok


@keras.saving.register_keras_serializable(package="test_op_sites")
class Branchy(HandAttention):
    """Another matmul in training only: its op sequence changes."""

    def call(self, x, training=None):
        if training:
            x = ops.matmul(x, ops.ones((32, 32)) / 32)
        return super().call(x)


def test_a_changed_op_sequence_names_the_layer():
    inputs = keras.Input((8, 32))
    outputs = keras.layers.Dense(4)(Branchy(name="branchy")(inputs))
    qmodel = keras_mp.quantize_model(keras.Model(inputs, outputs))
    qmodel.compile("sgd", "mse")
    with pytest.raises(ValueError, match="'branchy'.*takes another path"):
        qmodel.fit(_data(), np.zeros((16, 8, 4)), verbose=0)


@keras.saving.register_keras_serializable(package="test_op_sites")
class Scaled(keras.layers.Layer):
    """A custom layer whose quantized form wants more than Q/DQ on GEMM
    operands: its twin clips the output (a user's own rule)."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], 32), name="w")

    def call(self, x):
        return ops.matmul(x, self.w)


class ClippedScaled(keras_mp.quantization.QuantizedLayer):
    def call(self, x):
        return ops.clip(super().call(x), -1.0, 1.0)


def test_a_registered_twin_is_used_saved_and_reloaded(tmp_path):
    keras_mp.register_twin(Scaled, ClippedScaled)
    try:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8, 32))
        model = keras.Model(inputs, Scaled(name="scaled")(inputs))
        qmodel = keras_mp.quantize_model(model)
        keras_mp.calibrate(qmodel, _data(), verbose=0)
        (layer,) = twins.quantized_layers(qmodel)
        assert isinstance(layer, ClippedScaled) and isinstance(layer, Scaled)
        assert "scaled/matmul_0/operand_1" in {
            q.name for q in twins.quantizers(qmodel)
        }  # the op sites still work under the user's twin
        out = np.asarray(qmodel(_data()))
        assert out.max() <= 1.0 < np.asarray(model(_data())).max()
        qmodel.save(tmp_path / "q.keras")
        loaded = keras.saving.load_model(tmp_path / "q.keras", safe_mode=True)
        np.testing.assert_array_equal(np.asarray(loaded(_data())), out)
    finally:
        from keras_mp.quantization import recipe

        recipe._USER_TWINS.clear()
        recipe.twin_class_cache_clear()


def test_register_twin_refuses_what_is_not_a_twin():
    with pytest.raises(TypeError, match="QuantizedLayer"):
        keras_mp.register_twin(Scaled, keras.layers.Dense)
    with pytest.raises(TypeError, match="keras.layers.Layer subclass"):
        keras_mp.register_twin("Scaled", ClippedScaled)


def test_compare_onnx_finds_no_divergence_in_the_experts_layer(tmp_path):
    model = _model("experts")
    qmodel = keras_mp.quantize_model(model)
    keras_mp.calibrate(qmodel, _data(), verbose=0)
    path = str(tmp_path / "experts.onnx")
    keras_mp.export_onnx(qmodel, path, verify_data=_data())
    report = keras_mp.compare_onnx(qmodel, path, _data(8))
    assert report.first_divergence is None, str(report)


@keras.saving.register_keras_serializable(package="test_op_sites")
class Scan(keras.layers.Layer):
    """A Python loop over the time axis (as RWKV's time mixing): the loop
    body's matmul runs once per step, more steps than the probe's call."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], shape[-1]), name="w")

    def call(self, x):
        state = x[:, 0]
        for t in range(x.shape[1]):
            state = ops.tanh(ops.matmul(state, self.w) + x[:, t])
        return state

    def compute_output_shape(self, shape):
        return (shape[0], shape[-1])


def test_a_loop_over_a_shape_shares_its_body_quantizers():
    inputs = keras.Input((None, 32))
    model = keras.Model(inputs, Scan(name="scan")(inputs))
    qmodel = keras_mp.quantize_model(model)  # probed on one time step
    (layer,) = twins.quantized_layers(qmodel)
    assert len(layer.op_sites) == 1
    keras_mp.calibrate(qmodel, _data(), verbose=0)  # eight steps
    got, want = np.asarray(qmodel(_data())), np.asarray(model(_data()))
    assert 0 < np.linalg.norm(got - want) < 0.05 * np.linalg.norm(want)


def test_a_model_that_cannot_run_at_length_1_is_probed_longer():
    # The probe runs the model on zeros with unknown dimensions set to 1,
    # then 32, then 1024 (`recipe.PROBE_LENGTHS`): a model that needs 4
    # steps (Moonshine's strided audio stem needs hundreds) is probed at
    # 32. A model that runs on no zeros keeps its own GEMMs float with a
    # warning (`test_nested.py`, `Picky`).
    inputs = keras.Input((None, 32))
    x = keras.layers.Lambda(lambda t: t[:, :4])(inputs)
    x = keras.layers.Reshape((4, 32))(x)  # needs 4 steps: 1 fails
    x = HandAttention(name="hand")(x)
    model = keras.Model(inputs, keras.layers.Dense(32)(x))
    qmodel = keras_mp.quantize_model(model)
    (hand,) = [
        layer
        for layer in twins.quantized_layers(qmodel)
        if getattr(layer, "op_sites", None)
    ]
    assert len(hand.op_sites) == 6


@keras.saving.register_keras_serializable(package="test_op_sites")
class RoutedFirst(keras.layers.Layer):
    """A tiny router GEMM (N = 3: float by the small-GEMM rule) reads `x`
    first; the experts' einsum reads the same `x` after it."""

    def build(self, shape):
        d = shape[-1]
        self.w = self.add_weight(shape=(3, d, d), name="w")
        self.g = self.add_weight(shape=(d, 3), name="g")

    def call(self, x):
        gate = keras.ops.sigmoid(keras.ops.einsum("btd,de->bte", x, self.g))
        y = keras.ops.einsum("btd,edf->btef", x, self.w)
        return keras.ops.einsum("btef,bte->btf", y, gate)


@pytest.mark.gemm_rule  # the router stays float by the small-GEMM rule
def test_a_tensor_first_read_by_a_float_site_is_quantized_for_the_next():
    inputs = keras.Input((8, 32))
    model = keras.Model(inputs, RoutedFirst(name="routed")(inputs))
    qmodel = keras_mp.quantize_model(model)
    layer = qmodel.model.get_layer("routed")
    router, experts, _ = layer.op_sites
    assert router.get("float") and experts["operands"][0].get("same")
    quantizers = layer.op_quantizers_by_site[1]
    assert sorted(quantizers) == [0, 1]  # x and the expert weights
    x = np.random.default_rng(0).normal(size=(16, 8, 32)).astype("float32")
    keras_mp.calibrate(qmodel, x, verbose=0)
    assert float(quantizers[0].amax.numpy()) > 0

"""`compare_onnx` on models quantized in place (`RecordedModel`): the
layers inside a keras-hub ViT and inside custom layers are compared one by
one, the ones that cannot be are named with the reason, and a broken scale
is found at its layer."""

import re

import keras
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import keras_mp
from keras_mp import _models
from keras_mp.onnx.compare_trace import reachable
from keras_mp.quantization import twins

pytest.importorskip("keras_hub")

from tests.quantization.test_keras_hub import images, vit  # noqa: E402

L = keras.layers


def scale_weight(path, out, layer_scope, factor):
    """Multiplies the scale of the weight DequantizeLinear under
    `layer_scope` (a TF name scope fragment) by `factor`; returns `out`."""
    proto = onnx.load(path)
    inits = {i.name: i for i in proto.graph.initializer}
    dq = next(
        n
        for n in proto.graph.node
        if n.op_type == "DequantizeLinear"
        and f"/{layer_scope}/" in n.name
        and n.input[0] in inits
    )
    scale = numpy_helper.to_array(inits[dq.input[1]]) * np.float32(factor)
    name = dq.input[1] + "_broken"
    proto.graph.initializer.append(numpy_helper.from_array(scale, name))
    dq.input[1] = name
    onnx.save(proto, out)
    return out


@pytest.fixture(scope="module")
def vit_export(tmp_path_factory):
    keras.utils.set_random_seed(0)
    qmodel = keras_mp.quantize_model(vit())
    x = images(16)
    keras_mp.calibrate(qmodel, x, verbose=0)
    path = str(tmp_path_factory.mktemp("vit") / "vit.onnx")
    keras_mp.export_onnx(qmodel, path)
    return qmodel, path, x


def test_vit_inner_layers_are_compared_one_by_one(vit_export):
    qmodel, path, x = vit_export
    assert isinstance(qmodel, keras_mp.RecordedModel)
    report = keras_mp.compare_onnx(qmodel, path, x)
    names = [r.name for r in report.rows]
    # the backbone's own name comes from Keras' per-process counter
    root = names[0].split("/")[0]
    assert root.startswith("vi_t_backbone")
    block = f"{root}/vit_encoder/transformer_block_2"
    for inner in ("mha/query", "mlp/dense_1", "ln_2"):
        assert f"{block}/{inner}" in names
    # the attention's op-site Q/DQ (Keras' `dot_product_attention` path)
    assert f"{block}/mha/mha_dot_product_attention_0_probs" in names, names
    # every quantized twin and every activation Q/DQ has a row
    quantized = [
        r for r in report.rows if r.kind.startswith("Quantized")
    ]  # patch conv, 2 x (Q, K, V, output, 2 MLP Dense), 2 attention
    assert len(quantized) == len(twins.quantized_layers(qmodel)) == 15
    # 1 patch input, 2 x (the Q, K and V projections' inputs, the 4
    # attention matmul inputs, the output projection's and both MLP Dense
    # inputs); the three projection inputs are one ONNX Q/DQ
    qdqs = [r for r in report.rows if r.kind == "QuantizeActivation"]
    assert len(qdqs) == 21 and all(r.steps is not None for r in qdqs)
    assert len(qdqs) == sum(
        isinstance(layer, keras_mp.QuantizeActivation)
        for layer in _models.walk_layers(qmodel, owned=True)
    )
    assert max(r.steps for r in qdqs) <= 1
    assert max(r.rel_l2 for r in report.rows) < 1e-5
    assert report.first_divergence is None
    # none is dropped silently: each layer is a row or is named, with why
    reached = {path for _, path in reachable(qmodel)}
    listed = {n.split(" (call")[0] for n in names}
    listed |= {n for n, _ in report.unmatched}
    assert listed == reached
    # MultiHeadAttention's Dropout and Softmax are named from Keras'
    # per-process counter; its `dot_product_attention` path calls neither
    unmatched = {
        re.sub(r"/mha/(dropout|softmax)(_\d+)?$", r"/mha/\1", n).replace(
            root, "vi_t_backbone", 1
        ): why
        for n, why in report.unmatched
    }
    assert len(unmatched) == len(report.unmatched)
    assert unmatched == {
        "vi_t_backbone/vit_encoder/transformer_block_1/mha/dropout": (
            "not called when the model runs at inference"
        ),
        "vi_t_backbone/vit_encoder/transformer_block_2/mha/dropout": (
            "not called when the model runs at inference"
        ),
        "vi_t_backbone/vit_encoder/transformer_block_1/mha/softmax": (
            "not called when the model runs at inference"
        ),
        "vi_t_backbone/vit_encoder/transformer_block_2/mha/softmax": (
            "not called when the model runs at inference"
        ),
        "vi_t_backbone/vit_patching_and_embedding/position_embedding": (
            "no ONNX node carries its name (folded into a constant, or "
            "renamed by tf2onnx)"
        ),
    }
    assert "position_embedding (no ONNX node" in str(report)


def test_vit_broken_weight_scale_is_found_at_its_layer(vit_export, tmp_path):
    qmodel, path, x = vit_export
    bad = scale_weight(
        path,
        str(tmp_path / "bad.onnx"),
        "transformer_block_2_1/mlp_1/dense_1_1",
        1.5,
    )
    report = keras_mp.compare_onnx(qmodel, bad, x, samples=8)
    first = report.first_divergence
    root = report.rows[0].name.split("/")[0]
    assert first.name == f"{root}/vit_encoder/transformer_block_2/mlp/dense_1"
    assert first.rel_l2 > 0.1
    index = report.rows.index(first)
    # its input Q/DQ, just before it, still agrees within a step
    assert report.rows[index - 1].kind == "QuantizeActivation"
    assert report.rows[index - 1].steps <= 1
    assert not any(r.diverged for r in report.rows[:index])


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class Residual(L.Layer):
    """Dense -> LayerNorm + residual. Its sublayers are named: Keras would
    name them `dense_<n>` from a per-process counter, and a copy loaded in
    another state of the counter would not match the export's names."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.fc = L.Dense(units, name="fc")
        self.norm = L.LayerNormalization(name="norm")

    def build(self, shape):
        self.fc.build(shape)
        self.norm.build((*shape[:-1], self.units))

    def call(self, x):
        return self.norm(self.fc(x)) + x

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class NamedTwice(L.Layer):
    """One named Dense called twice (shared weights)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.fc = L.Dense(6, name="fc")

    def build(self, shape):
        self.fc.build((*shape[:-1], 6))

    def call(self, x):
        return self.fc(self.fc(x))


def custom_layer_model():
    """A Functional model with Dense layers inside custom layers, one of
    them called twice."""
    inputs = keras.Input((6,))
    x = L.Dense(8, name="stem")(inputs)
    x = Residual(8, name="block")(x)
    x = NamedTwice(name="twice")(L.Dense(6, name="narrow")(x))
    return keras.Model(inputs, L.Dense(3, name="head")(x), name="custom")


@pytest.fixture(scope="session")
def custom_export(tmp_path_factory):
    """`custom_layer_model` quantized in place, calibrated and exported
    (session-wide: `tests/cli/test_compare.py` uses it too)."""
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).standard_normal((32, 6)).astype("float32")
    with pytest.warns(UserWarning, match="called more than once"):
        qmodel = keras_mp.quantize_model(custom_layer_model())
    keras_mp.calibrate(qmodel, x, verbose=0)
    path = str(tmp_path_factory.mktemp("custom") / "custom.onnx")
    keras_mp.export_onnx(qmodel, path)
    return qmodel, path, x


def test_custom_layers_and_a_shared_layer(custom_export, tmp_path):
    qmodel, path, x = custom_export
    assert isinstance(qmodel, keras_mp.RecordedModel)
    fc = "custom/block/fc"
    report = keras_mp.compare_onnx(qmodel, path, x)
    names = [r.name for r in report.rows]
    for inner in (fc, "custom/block/norm", "custom/twice/fc"):
        assert inner in names, names
    assert "custom/twice/fc (call 2)" in names
    assert "custom/twice/fc/fc_input_0 (call 2)" in names  # its Q/DQ
    assert report.unmatched == []
    assert report.first_divergence is None
    assert max(r.rel_l2 for r in report.rows) < 1e-5

    bad = scale_weight(path, str(tmp_path / "bad.onnx"), "block_1/fc_1", 3.0)
    report = keras_mp.compare_onnx(qmodel, bad, x)
    assert report.first_divergence.name == fc
    assert f"first divergence at layer {fc!r}" in str(report)


def _zoo_export(name, directory, policy=None):
    """Zoo model `name` (benchmarks/bench_zoo.py), under `policy` when
    given, quantized, calibrated on 16 inputs and exported (parity
    checked): the model, its file and the inputs."""
    from benchmarks.bench_zoo import ZOO, refresh_batchnorm

    build, make_inputs = ZOO[name]
    keras.utils.set_random_seed(0)
    model = build()
    x = make_inputs(np.random.default_rng(0), 16)
    refresh_batchnorm(model, x)
    if policy is not None:
        model = keras_mp.apply_mixed_precision(model, policy)
    qmodel = keras_mp.quantize_model(model)
    keras_mp.calibrate(qmodel, x, verbose=0)
    path = str(directory / f"{name}.onnx")
    keras_mp.export_onnx(qmodel, path, verify_data=x)
    return qmodel, path, x


# The zoo's fast subset (`QUICK`): ViT is compared above; the float32
# graph of a mixed_float16 MobileNetV3Small is the plain one's (the export
# traces the float32 twin). Both MobileNetV3Small cases (22 s each on 2
# cores) run in the slow step of .ci/run.
@pytest.mark.parametrize(
    "name, policy",
    [
        pytest.param("BertBackbone_tiny", None, id="BertBackbone_tiny"),
        pytest.param(
            "MobileNetV3Small",
            "mixed_float16",
            id="MobileNetV3Small-mixed",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "MobileNetV3Small",
            None,
            id="MobileNetV3Small",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_zoo_fast_subset_exact_export_has_no_divergence(name, policy, tmp_path):
    qmodel, path, x = _zoo_export(name, tmp_path, policy)
    report = keras_mp.compare_onnx(qmodel, path, x)
    assert report.first_divergence is None, str(report)
    assert report.precision == "float32"
    qdqs = [r for r in report.rows if r.kind == "QuantizeActivation"]
    assert len(qdqs) > 10 and all(r.steps <= 1.0 + 1e-3 for r in qdqs)

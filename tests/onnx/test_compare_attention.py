"""`compare_onnx` on a quantized MultiHeadAttention: a Q/DQ tf2onnx
merged with another consumer's is compared at the merged one, and
layers past tolerance only through one-step rounding flips upstream are
told apart from a real divergence."""

import keras
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import keras_mp

L = keras.layers


def _attention_model(recurrent):
    """Embedding -> GRU (or Dense) -> self-attention -> residual Add ->
    pooling -> Dense. The Add and the attention both quantize `h`: the
    export keeps one Q/DQ for the two, named after either."""
    i = keras.Input((10,), dtype="int32")
    # the flip model: Keras' einsum path (dropout, off at inference) at a
    # width whose softmax flips one INT8 step against ONNX Runtime's on
    # some inputs (2 batches of 16 in 20 here; at width 16 none does)
    width, heads = (16, 2) if recurrent else (64, 4)
    x = L.Embedding(100, width, mask_zero=recurrent)(i)
    h = (
        L.GRU(width, return_sequences=True)(x)
        if recurrent
        else L.Dense(width)(x)
    )
    a = L.MultiHeadAttention(
        heads,
        width // heads,
        dropout=0.0 if recurrent else 0.1,
        name="attention",
    )(h, h)
    # named: the test reads rows by name, and Keras numbers unnamed layers
    # after what the process built before
    x = L.GlobalAveragePooling1D()(L.Add(name="add")([h, a]))
    return keras.Model(i, L.Dense(3)(x))


def _export(recurrent, tmp_path_factory):
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).integers(1, 100, (32, 10)).astype("int32")
    qmodel = keras_mp.quantize_model(_attention_model(recurrent))
    keras_mp.calibrate(qmodel, x, verbose=0)
    path = str(tmp_path_factory.mktemp("attention") / "m.onnx")
    keras_mp.export_onnx(qmodel, path, verify_data=x)
    return qmodel, path, x[:4]


@pytest.fixture(scope="module")
def masked(tmp_path_factory):
    """The GRU model, its padding mask reaching the attention."""
    return _export(True, tmp_path_factory)


@pytest.fixture(scope="module")
def flipping(tmp_path_factory):
    """The Dense model, on inputs where one attention probability lies on
    a rounding boundary and float noise flips it in ONNX Runtime, so that
    the output is past tolerance end to end. Which inputs do depends on
    the CPU's kernels (oneDNN or not): they are searched for, among
    batches of 4 random token sequences."""
    qmodel, path, x = _export(False, tmp_path_factory)

    def flips(batch):
        report = keras_mp.compare_onnx(qmodel, path, batch)
        probs = _row(report, PROBS)
        output = _row(report, "/attention_output")
        one_step = probs.steps == pytest.approx(1.0, abs=1e-3)
        return one_step, one_step and output.rel_l2 > report.max_rel_l2

    if flips(x)[1]:
        return qmodel, path, x
    # Flips are rarer on some CPUs (1 batch of 16 in 15 without oneDNN):
    # find a batch with one, then the sample of it that holds it.
    rng = np.random.default_rng(1)
    for _ in range(60):
        batch = rng.integers(1, 100, (16, 10)).astype("int32")
        if not flips(batch)[0]:
            continue
        for sample in np.split(batch, 16):
            if flips(sample)[1]:
                return qmodel, path, sample
    pytest.fail("no attention probability flips on 960 random inputs")


# The softmax output's Q/DQ: the first operand of the einsum path's second
# einsum (probs @ value).
PROBS = "_einsum_1_operand_0"


def _row(report, suffix):
    return next(r for r in report.rows if r.name.endswith(suffix))


def test_merged_input_qdq_is_compared_at_the_merged_one(masked):
    qmodel, path, x = masked
    report = keras_mp.compare_onnx(qmodel, path, x)
    query = _row(report, "query/query_input_0")
    add = _row(report, "add_input_0")
    # one ONNX Q/DQ for both, whichever name tf2onnx kept; never another
    # Q/DQ of the attention (the attention output's, 108 steps off)
    assert query.tensor == add.tensor
    assert "attention_output" not in query.tensor
    assert query.steps == add.steps == 0
    assert report.first_divergence is None, str(report)
    assert not any(r.rounding for r in report.rows)


def test_rounding_flips_are_not_a_divergence(flipping):
    qmodel, path, x = flipping
    report = keras_mp.compare_onnx(qmodel, path, x)
    probs = _row(report, PROBS)
    # the precondition: a one-step flip at the softmax's Q/DQ
    assert probs.steps == pytest.approx(1.0, abs=1e-3), str(report)
    output = _row(report, "/attention_output")
    assert output.rel_l2 > report.max_rel_l2  # past tolerance end to end
    assert output.rounding and not output.diverged
    assert report.first_divergence is None
    assert "only through rounding flips" in str(report)
    assert "| rounding |" in report.to_markdown()


def test_wrong_weight_after_a_flip_still_diverges(flipping, tmp_path):
    qmodel, path, x = flipping
    proto = onnx.load(path)
    scale = next(
        i
        for i in proto.graph.initializer
        if i.name.endswith("attention_output_1/MatMul_weight_scale")
    )
    value = numpy_helper.to_array(scale) * 1.5
    scale.CopyFrom(numpy_helper.from_array(value, scale.name))
    bad = str(tmp_path / "bad.onnx")
    onnx.save(proto, bad)
    report = keras_mp.compare_onnx(qmodel, bad, x)
    first = report.first_divergence
    assert first is not None and first.name.endswith("/attention_output")
    assert not first.rounding
    assert _row(report, PROBS).steps <= 1.0 + 1e-3

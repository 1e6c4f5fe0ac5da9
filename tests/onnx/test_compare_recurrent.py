"""`compare_onnx` on recurrent models: an LSTM exports to an ONNX `LSTM`
op (a Bidirectional one to one op with two directions), a GRU and a
SimpleRNN to a `Loop`; each recurrent layer, each direction of a
Bidirectional, and the states of `return_state` are compared with the
op's outputs in Keras' layout, the cells inside the loop are named as not
compared, and a broken weight is found at its layer."""

import keras
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import keras_mp
from keras_mp.datasets import load_digits
from keras_mp.onnx.compare_graph import _recurrent_views
from keras_mp.onnx.compare_trace import IN_LOOP
from keras_mp.onnx.graph import attr

L = keras.layers


def _model():
    """Every recurrent export in one small model. ONNX LSTM ops: a
    Bidirectional LSTM returning sequences (concat), an LSTM returning
    its last output and its states. ONNX Loops: a SimpleRNN returning
    sequences, a Bidirectional GRU returning its last outputs, summed.
    No loop: an unrolled LSTM. Between them a Dense per step, quantized
    in INT8."""
    inputs = keras.Input((8, 8))
    x = L.Bidirectional(L.LSTM(6, return_sequences=True), name="bilstm")(inputs)
    x = L.Dense(6, name="step_dense")(x)
    out, _, cell = L.LSTM(5, return_state=True, name="lstm")(x)
    unrolled = L.LSTM(3, unroll=True, name="unrolled")(x)
    x = L.SimpleRNN(6, return_sequences=True, name="rnn")(x)
    x = L.Bidirectional(L.GRU(5), merge_mode="sum", name="bigru")(x)
    x = L.Concatenate(name="join")([out, cell, unrolled, x])
    return keras.Model(inputs, L.Dense(3, name="head")(x))


def _recurrent(model):
    """(rows, cells): the paths of the rows every export of `model` must
    have (each recurrent layer, each layer of a Bidirectional, each state
    of `return_state`, each step of an unrolled layer's cell), and of the
    cells inside loops. Paths are
    below the float model; the two layers of a Bidirectional are named
    from Keras' per-process counter (`forward_lstm_1`)."""
    rows, cells = [], []
    for layer in getattr(model, "model", model).layers:
        if isinstance(layer, L.Bidirectional):
            for inner in (layer.forward_layer, layer.backward_layer):
                rows.append(f"{layer.name}/{inner.name}")
                cells.append(f"{layer.name}/{inner.name}/{inner.cell.name}")
        elif isinstance(layer, L.RNN) and layer.unroll:
            # one cell call per step, at the top of the graph
            cell = f"{layer.name}/{layer.cell.name}"
            rows += [cell] + [f"{cell} (call {t})" for t in range(2, 9)]
        elif isinstance(layer, L.RNN):
            cells.append(f"{layer.name}/{layer.cell.name}")
        else:
            continue
        rows.append(layer.name)
        if getattr(layer, "return_state", False):
            rows += [f"{layer.name} (state {i})" for i in (1, 2)]
    return rows, cells


@pytest.fixture(scope="module")
def digits_rows():
    """16 digits images read as 8 steps of 8 features (their rows)."""
    (x, _), _ = load_digits()
    return x[:16, :, :, 0]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, digits_rows):
    """mode -> (model, ONNX path), float or INT8, exported once and
    verified by the export's own parity check."""
    folder = tmp_path_factory.mktemp("compare_recurrent")
    done = {}

    def export(mode):
        if mode not in done:
            keras.utils.set_random_seed(0)
            model = _model()
            if mode == "int8":
                model = keras_mp.quantize_model(model)
                keras_mp.calibrate(model, digits_rows, verbose=0)
            path = str(folder / f"{mode}.onnx")
            keras_mp.export_onnx(model, path, verify_data=digits_rows)
            done[mode] = model, path
        return done[mode]

    return export


def _by_name(report, model):
    """Rows and unmatched reasons by layer path below the float model (a
    `RecordedModel`'s paths start with its float model's name)."""
    inner = getattr(model, "model", None)
    prefix = f"{inner.name}/" if inner is not None else ""

    def below(name):
        return name[len(prefix) :] if name.startswith(prefix) else name

    rows = {below(r.name): r for r in report.rows}
    return rows, {below(n): why for n, why in report.unmatched}


@pytest.mark.parametrize("mode", ["float", "int8"])
def test_exact_recurrent_export_has_no_divergence(exported, digits_rows, mode):
    """Every recurrent layer, direction and state is compared in Keras'
    layout, within float32 rounding; the cells are named as inside a
    Loop body, never compared with a wrong tensor."""
    model, path = exported(mode)
    report = keras_mp.compare_onnx(model, path, digits_rows)
    assert report.first_divergence is None, str(report)
    rows, why = _by_name(report, model)
    expected, cells = _recurrent(model)
    assert len(expected) == 19
    for name in expected:
        assert name in rows, (name, str(report))
        assert rows[name].rel_l2 < 1e-5, str(report)
    for cell in cells:
        assert why.pop(cell) == IN_LOOP
    # A Q/DQ moved past the layer holds INT8 codes: the Concatenate the
    # head's input Q/DQ follows (see docs/compare.md, "Limits")
    assert set(why) <= ({"join"} if mode == "int8" else set()), why
    assert "inside a Loop body" in str(report)


def _edit_initializer(path, out, name, edit):
    """Writes `path` to `out` with initializer `name` replaced by
    `edit(values)`; returns `out`."""
    proto = onnx.load(path)
    init = next(i for i in proto.graph.initializer if i.name == name)
    values = edit(numpy_helper.to_array(init).copy())
    init.CopyFrom(numpy_helper.from_array(values, name))
    onnx.save(proto, out)
    return out


def _directions(model, name):
    """The row paths of the two layers of Bidirectional `name`."""
    layer = getattr(model, "model", model).get_layer(name)
    inner = (layer.forward_layer, layer.backward_layer)
    return [f"{name}/{one.name}" for one in inner]


def test_broken_lstm_direction_is_found_at_its_layer(
    exported, digits_rows, tmp_path
):
    """The backward direction's input weights of the Bidirectional LSTM
    op scaled: its layer is the first divergence, the forward one is
    not."""
    model, path = exported("int8")
    bilstm = next(
        n
        for n in onnx.load(path).graph.node
        if n.op_type == "LSTM" and attr(n, "direction", b"") == b"bidirectional"
    )
    weight = bilstm.input[1]  # W: (directions, 4 * hidden, features)

    def scale_backward(w):
        w[1] *= 1.5
        return w

    bad = _edit_initializer(
        path, str(tmp_path / "bad.onnx"), weight, scale_backward
    )
    report = keras_mp.compare_onnx(model, bad, digits_rows, samples=8)
    rows, _ = _by_name(report, model)
    forward, backward = _directions(model, "bilstm")
    assert report.first_divergence is rows[backward], str(report)
    assert "direction 1" in rows[backward].tensor
    assert not rows[forward].diverged
    assert rows["bilstm"].diverged


def test_broken_dense_after_lstm_is_found_at_the_dense(
    exported, digits_rows, tmp_path
):
    """A quarter of the INT8 weights of the Dense between the recurrent
    layers negated: the Dense diverges first, the Bidirectional LSTM
    before it agrees, the LSTM and the SimpleRNN after it diverge."""
    model, path = exported("int8")
    proto = onnx.load(path)
    weight = next(
        i.name
        for i in proto.graph.initializer
        if "step_dense" in i.name and i.data_type == onnx.TensorProto.INT8
    )

    def negate(w):
        w.flat[: w.size // 4] *= -1
        return w

    bad = _edit_initializer(path, str(tmp_path / "bad.onnx"), weight, negate)
    report = keras_mp.compare_onnx(model, bad, digits_rows, samples=8)
    assert report.first_divergence.name.endswith("/step_dense"), str(report)
    rows, _ = _by_name(report, model)
    assert not rows["bilstm"].diverged
    assert rows["lstm"].diverged and rows["rnn"].diverged


def test_broken_gru_kernel_in_a_loop_body_is_found_at_the_gru(
    exported, digits_rows, tmp_path
):
    """The kernel the backward GRU's Loop body reads, scaled: the
    backward GRU diverges first."""
    model, path = exported("float")
    loops = [n for n in onnx.load(path).graph.node if n.op_type == "Loop"]
    backward = next(n for n in loops if "backward_gru" in n.name)
    inits = {i.name for i in onnx.load(path).graph.initializer}
    kernel = next(
        t for t in backward.input if t in inits and "Cast/" in t
    )  # the input kernel (Cast_1: the recurrent one)
    bad = _edit_initializer(
        path, str(tmp_path / "bad.onnx"), kernel, lambda w: w * 1.5
    )
    report = keras_mp.compare_onnx(model, bad, digits_rows, samples=8)
    rows, _ = _by_name(report, model)
    forward, backward = _directions(model, "bigru")
    assert report.first_divergence is rows[backward], str(report)
    assert not rows[forward].diverged and not rows["rnn"].diverged


def test_recurrent_views_read_directions_as_keras_does():
    """ONNX `Y` is `(T, D, N, H)`, `Y_h` `(D, N, H)`; a Bidirectional
    concatenates, sums, averages or multiplies its layers' outputs."""
    rng = np.random.default_rng(0)
    y = rng.random((5, 2, 3, 4))
    views = dict(_recurrent_views(0, 2))
    forward, backward = y[:, 0], y[:, 1]
    assert np.array_equal(
        views["direction 1, time reversed"](y), backward[::-1]
    )
    assert np.array_equal(
        views["directions concatenated"](y),
        np.concatenate([forward, backward], -1),
    )
    assert np.allclose(
        views["directions averaged"](y), (forward + backward) / 2
    )
    y_h = rng.random((2, 3, 4))
    states = dict(_recurrent_views(1, 2))
    assert np.array_equal(states["direction 0"](y_h), y_h[0])
    assert np.allclose(states["directions multiplied"](y_h), y_h[0] * y_h[1])
    assert "time reversed" not in states  # a state has no time axis
    assert [label for label, _ in _recurrent_views(1, 1)] == [""]

"""The Keras side of `compare_onnx`: the model traced as `export_onnx`
traces it, with the output of every layer call inside it (nested models,
custom layers, keras-hub backbones) fetched."""

import contextlib
import dataclasses

import numpy as np

from keras_mp import _inputs
from keras_mp._models import walk_layers
from keras_mp.quantization.twins import WeightQuantizer, quantizers

NOT_CALLED = "not called when the model runs at inference"
IN_LOOP = (
    "inside a Loop body: a recurrent cell's steps run inside its layer's "
    "ONNX LSTM/GRU/RNN op or Loop; compared at that layer's output"
)


@dataclasses.dataclass
class Call:
    """One layer call seen while tracing the model: where its output sits
    among the traced function's outputs."""

    layer: object
    name: str
    scope: str
    tensor: str
    output: int


def reachable(model):
    """(layer, path) for every layer inside `model` a report can compare:
    nested models and the layers inside custom layers included, the
    activation quantizers of quantized layers as layers of their own, input
    layers and weight quantizers (a weight's Q/DQ is an initializer,
    checked at its layer's output) left out. Paths are the names from the
    model down, made unique."""
    import keras

    found, paths = [], set()
    for layer, parents in _walk(model):
        if isinstance(layer, (keras.layers.InputLayer, WeightQuantizer)):
            continue
        path = base = "/".join(p.name for p in parents + (layer,))
        k = 1
        while path in paths:  # keras-hub repeats names (`dropout`)
            k += 1
            path = f"{base} #{k}"
        paths.add(path)
        found.append((layer, path))
    return found


def in_loop(model):
    """The ids of the layers inside `model` that run inside a recurrent
    layer's time loop: the cell of each `keras.layers.RNN` (`LSTM`,
    `GRU`, `SimpleRNN`, the two of a `Bidirectional`) that is not
    unrolled, and the layers inside that cell. Keras calls such a cell
    once outside the loop too (a probe for its output shape, whose
    result is dropped), so its calls are none of the graph's tensors."""
    import keras

    return {
        id(layer)
        for layer, parents in _walk(model)
        if any(
            isinstance(p, keras.layers.RNN) and not p.unroll for p in parents
        )
    }


def _walk(model):
    return walk_layers(
        model,
        include_models=True,
        with_parents=True,
        owned=True,
    )


@contextlib.contextmanager
def _recording(layers, calls, fetched, skipped, graph, inject):
    """Within the block, each layer's `call` also appends its output (its
    first floating tensor) to `fetched` and a `Call` to `calls`, in the
    order the calls finish (inner layers before the layer holding them);
    `skipped` gets, by layer id, why a call could not be fetched. A call
    named in `inject` (name -> (tensor, switch)) returns that tensor
    instead of its output where its boolean switch is on."""
    import keras
    import tensorflow as tf

    count = {}

    def hook(layer, path, call):
        def recorded(*args, **kwargs):
            out = call(*args, **kwargs)
            tensors = [t for t in keras.tree.flatten(out) if tf.is_tensor(t)]
            floats = [t for t in tensors if t.dtype.is_floating]
            if not tensors:
                return out  # a symbolic call (Keras' shape inference)
            if not floats:
                skipped[id(layer)] = "no floating-point output to compare"
                return out
            if getattr(floats[0], "graph", None) is not graph:
                skipped[id(layer)] = (
                    "called inside a TensorFlow control-flow branch, whose "
                    "tensors the trace cannot return"
                )
                return out
            count[id(layer)] = n = count.get(id(layer), 0) + 1
            name = path if n == 1 else f"{path} (call {n})"
            if name in inject and tf.is_tensor(out):
                value, switch = inject[name]
                out = floats[0] = tf.where(
                    switch, tf.cast(value, out.dtype), out
                )
            scope = tf.get_current_name_scope()
            # A recurrent layer's states (`return_state=True`) are rows of
            # their own: the ONNX op holds them apart (Y_h, Y_c).
            kept = (
                floats if getattr(layer, "return_state", False) else [floats[0]]
            )
            for i, tensor in enumerate(kept):
                fetched.append(tensor)
                calls.append(
                    Call(
                        layer,
                        f"{name} (state {i})" if i else name,
                        scope,
                        tensor.name,
                        len(fetched) - 1,
                    )
                )
            return out

        return recorded

    # An instance attribute shadows the class's `call` for this trace
    # only; set past Keras' attribute tracking, as a function is no state.
    own = [(layer, layer.__dict__.get("call")) for layer, _ in layers]
    for layer, path in layers:
        object.__setattr__(layer, "call", hook(layer, path, layer.call))
    try:
        yield
    finally:
        for layer, previous in own:
            if previous is None:
                object.__delattr__(layer, "call")
            else:
                object.__setattr__(layer, "call", previous)


def trace(model, specs, inject=()):
    """Traces `model` as `export_onnx` does, with every reachable layer's
    output made an output of the traced function.

    The trace calls the model exactly as the export's did, so TensorFlow
    names its ops the same way (Keras opens one name scope per layer
    call, and TF uniquifies them in the same order): tf2onnx named the
    ONNX nodes after those ops, which is how a layer finds its tensors.

    `inject`: `(call name, array)` pairs: the traced function takes, after
    the model's inputs, one input of each array's shape and dtype (in this
    order), then a boolean vector with one switch per pair; a call whose
    switch is on returns that input instead of its output. `compare_onnx`
    feeds ONNX Runtime's values of some Q/DQs to the rest of the model
    that way, choosing which per run on one trace.

    Returns:
        The traced `tf.function` (its outputs: the fetched tensors), the
        `Call`s, and `(layer, path, why)` for the layers with no call
        fetched.
    """
    import tensorflow as tf

    everything, looped = reachable(model), in_loop(model)
    # A cell's calls happen inside its layer's loop: not hooked at all.
    layers = [(lay, path) for lay, path in everything if id(lay) not in looped]
    calls, skipped = [], dict.fromkeys(looped, IN_LOOP)
    signature = [
        tf.TensorSpec((None,) + tuple(s.shape[1:]), s.dtype, name=s.name)
        for s in specs
    ]
    names = [name for name, _ in inject]
    signature += [
        tf.TensorSpec((None,) + value.shape[1:], value.dtype)
        for _, value in inject
    ]
    if inject:
        signature.append(tf.TensorSpec((len(inject),), tf.bool))

    @tf.function(input_signature=signature)
    def run(*args):
        fetched = []
        calls.clear()
        graph = tf.compat.v1.get_default_graph()
        inputs, injected = args[: len(specs)], args[len(specs) :]
        fed = {
            name: (value, injected[-1][i])
            for i, (name, value) in enumerate(zip(names, injected))
        }
        with _recording(layers, calls, fetched, skipped, graph, fed):
            model(_inputs.call_arg(model, inputs, specs), training=False)
        return fetched

    run.get_concrete_function()
    called = {id(c.layer) for c in calls}
    never = [
        (layer, path, skipped.get(id(layer), NOT_CALLED))
        for layer, path in everything
        if id(layer) not in called
    ]
    return run, calls, never


@contextlib.contextmanager
def exported_ranges(model, smallest_scale):
    """Within the block, every calibrated quantizer of `model` (weights
    and activations) whose scale (`amax / qmax`, per channel) is below
    `smallest_scale` quantizes with that scale, as a float16 export
    writes it (`keras_mp.onnx.subnormal` raises such scales to float16's
    smallest normal): the grid the graph computes on. The ranges are put
    back on exit. `smallest_scale` 0 (a float32 graph) changes nothing."""
    changed = []
    for found in quantizers(model, "compare_onnx") if smallest_scale else ():
        quantizer = found.quantizer
        amax = np.asarray(quantizer.amax.numpy())
        least = np.float32(smallest_scale) * np.float32(quantizer.format.qmax)
        raised = np.where(amax > 0, np.maximum(amax, least), amax)
        if np.any(raised != amax):
            changed.append((quantizer, amax))
            quantizer.amax.assign(raised.astype(amax.dtype))
    try:
        yield
    finally:
        for quantizer, amax in changed:
            quantizer.amax.assign(amax)


def keras_values(run, inputs, batch_size=256, switches=None):
    """The traced function's outputs on `inputs`, run in batches (with
    `switches`, the boolean vector of a trace with `inject`, whole)."""
    fixed = [] if switches is None else [np.asarray(switches, bool)]
    chunks = [
        [
            np.asarray(o)
            for o in run(*[x[i : i + batch_size] for x in inputs], *fixed)
        ]
        for i in range(0, len(inputs[0]), batch_size)
    ]
    return [np.concatenate(c) for c in zip(*chunks)]

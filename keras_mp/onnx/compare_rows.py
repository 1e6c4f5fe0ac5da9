"""Judging each layer call of `compare_onnx`: its error against the
ONNX tensor that fits it best, the tolerances of the graph's float type,
and the rows past them that only rounding at Q/DQs upstream explains."""

import dataclasses

from keras_mp.onnx.compare_graph import best_layout
from keras_mp.onnx.compare_match import is_qdq, qdq_steps
from keras_mp.onnx.compare_trace import keras_values, trace


@dataclasses.dataclass
class LayerError:
    """ONNX Runtime against Keras at one layer's output.

    Attributes:
        depth: int. The position of the layer call among all the calls
            of the trace, in the order they finish.
        name: str. The layer's path of names from the model down
            (`vi_t_backbone/vit_encoder/transformer_block_1/mha/query`; its name
            for a layer of the model itself), `(call 2)` added for a
            layer's second call.
        kind: str. Its type (`QuantizedDense` for a quantized layer).
        tensor: str. The ONNX tensor compared with the layer's output.
        max_abs: float. Max absolute difference.
        rel_l2: float. `||onnx - keras|| / ||keras||`.
        steps: float or None. At an activation quantizer (a Q/DQ of its
            own, which is judged by this only), the difference of its
            output in quantization steps (`amax / 127` for 8 bits); None
            elsewhere.
        diverged: bool. Past the report's tolerance.
        rounding: bool. Past the tolerance, but only through one-step
            rounding flips at Q/DQs before it: within it once Keras is
            fed ONNX Runtime's values of those Q/DQs (`diverged` False).
    """

    depth: int
    name: str
    kind: str
    tensor: str
    max_abs: float
    rel_l2: float
    steps: float = None
    diverged: bool = False
    rounding: bool = False


def rows_of(matched, values, graph, got, tolerance, names=None):
    """(`LayerError` rows, (path, why) for the calls no tensor fitted,
    ONNX Runtime's value of each Q/DQ row in Keras' layout by name).
    `values` are indexed as `names[call.name]` when given (a later
    trace), else by `call.output`."""
    rows, unmatched, qdqs = [], [], {}
    for depth, call, views in matched:
        index = call.output if names is None else names.get(call.name)
        if index is None:
            continue
        want = values[index]
        found = [
            (fit, f"{t} ({label})" if label else t)
            for t, label in views
            if (
                fit := best_layout(
                    graph.view(t, label, got[t]), want, graph.tiny
                )
            )
            is not None
        ]
        if not found:
            unmatched.append(
                (
                    call.name,
                    "no ONNX tensor of its output's size (tried "
                    + ", ".join(
                        repr(t) for t in dict.fromkeys(t for t, _ in views)
                    )
                    + ")",
                )
            )
            continue
        (err, layout), tensor = min(found, key=lambda f: f[0][0][1])
        layer, steps, qdq = call.layer, None, False
        if is_qdq(layer):
            qdq = True
            steps = qdq_steps(layout, want, layer, graph.eps)
            qdqs[call.name] = layout
        # A Q/DQ's output is judged in steps only: flips of single values
        # are rounding, however many there are.
        rel_l2 = None if qdq else err[1]
        diverged = _diverged(rel_l2, steps, *tolerance)
        rows.append(
            LayerError(
                depth,
                call.name,
                type(layer).__name__,
                tensor,
                *err,
                steps,
                diverged,
            )
        )
    return rows, unmatched, qdqs


def mark_rounding(traced, specs, inputs, rows, qdqs, fit):
    """Marks `rounding` the diverged rows that only rounding at Q/DQs
    upstream explains: Keras is run again with each Q/DQ whose output
    differs from ONNX Runtime's within `max_steps` (a flip, or a 16-bit
    graph's rounding) returning ONNX Runtime's value instead of its own,
    so the layers after it read the inputs ONNX's did; a row within
    tolerance then is rounding carried forward, not an export fault (a
    wrong weight, scale or op still diverges). Repeated while new Q/DQs
    come within tolerance, on one trace whose Q/DQs are switched on
    (`compare_trace.trace`'s `inject`)."""
    matched, graph, got, tolerance = fit
    inject = [(r.name, qdqs[r.name]) for r in rows if r.name in qdqs]
    run, calls, _ = trace(traced, specs, inject)
    names = {c.name: c.output for c in calls}
    arrays = inputs + [v for _, v in inject]
    fed, current = set(), rows
    # each pass feeds at least one more Q/DQ, or stops
    for _ in inject:
        flipped = fed | {
            r.name
            for r in current
            if r.steps is not None and not r.diverged and r.steps > 0
        }
        if flipped == fed or not any(r.diverged for r in current):
            break
        fed = flipped
        switches = [name in fed for name, _ in inject]
        values = keras_values(run, arrays, switches=switches)
        current, _, _ = rows_of(matched, values, graph, got, tolerance, names)
    if not fed:
        return
    within = {r.name for r in current if not r.diverged}
    for row in rows:
        if row.diverged and row.name in within:
            row.diverged, row.rounding = False, True


# (max_steps, max_rel_l2) by the graph's float type. A float16 graph
# (`export_onnx(dtype="float16")`) rounds every activation to 11 significant
# bits (a relative error up to 2**-11 per op, which adds up over layers),
# and a Q/DQ's scale and output too: each moves a code of 127 by up to
# 127 * 2**-11 = 0.06 step, on top of a rounding flip.
_FLOAT16_STEPS = 1.0 + 2 * 127 * 2.0**-11
_TOLERANCES = {"float32": (1.0, 1e-3), "float16": (_FLOAT16_STEPS, 1e-2)}

# A one-step rounding flip measures 1 step only up to float32 rounding of
# the step itself (1.0000008, say): not a divergence at max_steps=1.
_STEP_SLACK = 1e-3


def _diverged(rel_l2, steps, max_steps, max_rel_l2):
    """Past a tolerance: `rel_l2` (None: not judged) or `steps`."""
    return (rel_l2 is not None and rel_l2 > max_rel_l2) or (
        steps is not None and steps > max_steps + _STEP_SLACK
    )


def tolerances(graph, max_steps=None, max_rel_l2=None):
    """(max_steps, max_rel_l2): those given, else the defaults of the
    graph's float type (`Graph.precision`)."""
    steps, rel_l2 = _TOLERANCES[graph.precision]
    return (
        steps if max_steps is None else max_steps,
        rel_l2 if max_rel_l2 is None else max_rel_l2,
    )

"""The ONNX side of `compare_onnx`: the graph's tensors by name scope,
the layouts a Keras output can take in it, and ONNX Runtime's values of
any of its tensors."""

import itertools
import math
import os

import numpy as np

from keras_mp._compat import optional_import
from keras_mp.onnx.graph import RECURRENT_OPS, attr
from keras_mp.onnx.parity import (
    ReferenceSession,
    ort_session,
    reference_only,
    run_session,
)

FLOAT_TYPES = (1, 10, 11)  # onnx.TensorProto FLOAT, FLOAT16, DOUBLE
FLOAT16 = 10
BFLOAT16 = 16


# Layouts tried per tensor: every order of the Keras output's axes up to
# this rank (6! = 720 shape checks), the identity alone beyond it.
_MAX_PERMUTED_RANK = 6


def _merges(shape, target):
    """Whether `target` is `shape` with runs of consecutive axes merged
    (size-1 axes left out of both)."""
    shape = [d for d in shape if d != 1]
    k = 0
    for want in (d for d in target if d != 1):
        size = 1
        while size < want and k < len(shape):
            size *= shape[k]
            k += 1
        if size != want:
            return False
    return k == len(shape)


def _orders(want_shape, got_shape):
    """The orders of the Keras output's axes whose transpose, with runs of
    consecutive axes merged and size-1 axes left out, has the ONNX
    tensor's shape: NCHW for NHWC, `(N, C, 1, W)` for a Conv1D's
    `(N, W, C)`, time first `(T, N, ...)`, `(batch * tokens, features)`.
    Past `_MAX_PERMUTED_RANK` axes, the Keras order only."""
    axes = [i for i, d in enumerate(want_shape) if d != 1]
    if len(axes) > _MAX_PERMUTED_RANK:
        return [tuple(range(len(want_shape)))]
    found = []
    for order in itertools.permutations(axes):
        if _merges([want_shape[i] for i in order], got_shape):
            found.append(order)
    return found


def fits(shape, want):
    """Whether an ONNX static shape can hold a Keras output shape, the
    values rearranged as `_orders` allows: its known sizes multiply to a
    divisor of the Keras output's (whose batch size is unknown), or, all
    of them known (the batch merged into a static axis), to a multiple."""
    if shape is None:
        return True
    known = math.prod(d for d in shape if d is not None)
    need = math.prod(d for d in want[1:] if d is not None)
    if None in shape:
        return need % max(known, 1) == 0
    return known % max(need, 1) == 0


def _layouts(got, want):
    """`got` brought to `want`'s shape every way that keeps the values:
    the axes of `want` in some order, runs of them merged, size-1 axes
    added or dropped (`_orders`), the order derived from the shapes
    alone. None fits when the sizes differ."""
    if got.size != want.size:
        return []
    options = []
    for order in _orders(want.shape, got.shape):
        shape = [want.shape[i] for i in order]
        back = np.transpose(got.reshape(shape), np.argsort(order))
        options.append(back.reshape(want.shape))
    return options


def error(got, want):
    """(max abs, rel L2) with `got` brought to `want`'s layout, the best
    over the layouts that fit (`_layouts`); None when none does."""
    best = best_layout(got, want)
    return None if best is None else best[0]


def best_layout(got, want, floor=0.0):
    """((max abs, rel L2), `got` in `want`'s layout) for the layout of
    `got` that fits `want` best (`error`); None when none fits. The
    relative L2 takes each value of `want` as at least `floor` in size
    (a 16-bit graph's smallest normal number, below which its step no
    longer shrinks with the value)."""
    best = None
    norm = max(float(np.linalg.norm(np.maximum(np.abs(want), floor))), 1e-12)
    for g in _layouts(got, want):
        diff = np.abs(g.astype(np.float64) - want)
        err = (float(diff.max()), float(np.linalg.norm(diff)) / norm)
        best = (err, g) if best is None or err[1] < best[0][1] else best
    return best


def _recurrent_views(slot, directions):
    """(label, function) pairs: the arrays a Keras layer's output can be
    of output `slot` of an ONNX LSTM/GRU/RNN op with `directions`
    directions, the output as it is first (`_layouts` brings its
    `(T, 1, N, H)` to `(N, T, H)`).

    `Y` (slot 0) is `(T, D, N, H)` in input time order; `Y_h`, `Y_c` are
    `(D, N, H)`. A Keras layer with `go_backwards` returns its sequence
    last step first, and `Bidirectional` concatenates, sums, averages or
    multiplies its two layers' outputs (`merge_mode`), both in input
    order.
    """
    axis = 1 if slot == 0 else 0
    views = [("", _same)]
    if slot == 0:
        views.append(("time reversed", _reversed))
    if directions != 2:
        return views
    for k in range(2):
        views.append((f"direction {k}", _direction(axis, k)))
        if slot == 0:
            views.append(
                (f"direction {k}, time reversed", _direction(axis, k, True))
            )
    merges = {
        "concatenated": lambda y: np.concatenate(
            [np.take(y, 0, axis), np.take(y, 1, axis)], axis=-1
        ),
        "summed": lambda y: y.sum(axis),
        "averaged": lambda y: y.mean(axis),
        "multiplied": lambda y: y.prod(axis),
    }
    return views + [(f"directions {k}", f) for k, f in merges.items()]


def _same(y):
    return y


def _reversed(y):
    return y[::-1]


def _direction(axis, k, reverse=False):
    def view(y):
        y = np.take(y, k, axis)
        return y[::-1] if reverse else y

    return view


def _scopes(node):
    """Every name scope the node's name or its outputs' names lie in."""
    scopes = set()
    for name in (node.name, *node.output):
        parts = name.split("/")
        scopes.update("/".join(parts[:k]) for k in range(1, len(parts)))
    return scopes


def _adopted(nodes):
    """Scopes for the nodes tf2onnx named after no scope, by node index.

    A recurrent op (`LSTM__33`) takes those of the scoped nodes it reads
    from and feeds, reached through unscoped nodes (the Unsqueeze of an
    initial state, the Squeeze and Slice of a direction, a Q/DQ moved next
    to it). Any other unscoped node (the MatMuls, Reshapes and Squeezes
    tf2onnx decomposes an `Einsum` into, a Q/DQ it inserted) takes those
    of the scoped nodes it reads from, through unscoped nodes: the output
    of a layer whose last op is an einsum is then among its scope's
    tensors."""
    nodes = list(nodes)
    found = _adopted_recurrent(nodes)
    carried = {}  # tensor -> scopes of the nearest scoped producers
    for index, node in enumerate(nodes):
        own = _scopes(node) or found.get(index)
        if own is None:
            own = set().union(*(carried.get(i, ()) for i in node.input))
            if own:
                found[index] = own
        for out in node.output:
            carried[out] = own
    return found


def _adopted_recurrent(nodes):
    """`_adopted` for the recurrent ops named after no scope."""
    producers = {o: n for n in nodes for o in n.output}
    consumers = {}
    for node in nodes:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    found = {}
    for index, node in enumerate(nodes):
        if node.op_type not in RECURRENT_OPS or _scopes(node):
            continue
        scopes, seen = set(), {id(node)}
        todo = [node]
        while todo:
            current = todo.pop()
            near = [producers[i] for i in current.input if i in producers]
            near += [c for o in current.output for c in consumers.get(o, [])]
            for other in near:
                if id(other) in seen or other.op_type in RECURRENT_OPS:
                    continue
                seen.add(id(other))
                if own := _scopes(other):
                    scopes |= own
                else:
                    todo.append(other)
        found[index] = scopes
    return found


class Graph:
    """The ONNX graph's tensor types, and its nodes grouped by every name
    scope their names (or their outputs' names) lie in: a layer's group
    holds the nodes of the layers inside it too. A recurrent op tf2onnx
    named after no scope joins the groups of the nodes around it."""

    def __init__(self, proto):
        onnx = optional_import("onnx")
        self.proto = proto
        inferred = onnx.shape_inference.infer_shapes(proto).graph
        self.types = {}
        for info in list(inferred.value_info) + list(inferred.output):
            t = info.type.tensor_type
            dims = tuple(
                d.dim_value if d.HasField("dim_value") else None
                for d in t.shape.dim
            )
            self.types[info.name] = (
                t.elem_type,
                dims if t.HasField("shape") else None,
            )
        self.initializers = {i.name for i in proto.graph.initializer}
        self._scales = _scalar_scales(proto)
        self._dqs = [
            n
            for n in proto.graph.node
            if n.op_type == "DequantizeLinear"
            and n.input[0] not in self.initializers
        ]
        self._dq_by_output = {n.output[0]: n for n in self._dqs}
        # A typed export (`dtype="float16"`): float16 between its float32
        # boundaries; or bfloat16, whose Q/DQ ONNX Runtime cannot run.
        self.float16, self.bfloat16 = (
            any(elem == half for elem, _ in self.types.values())
            or any(i.data_type == half for i in proto.graph.initializer)
            for half in (FLOAT16, BFLOAT16)
        )
        # float16 keeps a fixed step below its smallest normal number:
        # errors of smaller values are relative to it (`best_layout`).
        self.tiny = float(np.finfo(np.float16).tiny) if self.float16 else 0.0
        self.precision = "float16" if self.float16 else "float32"
        # The relative resolution of its activations (`qdq_steps`).
        self.eps = float(
            np.finfo(np.float16 if self.float16 else np.float32).eps
        )
        self.groups, self.recurrent = {}, {}
        adopted = _adopted(proto.graph.node)
        for index, node in enumerate(proto.graph.node):
            scopes = _scopes(node) | adopted.get(index, set())
            for scope in scopes:
                self.groups.setdefault(scope, []).append(node)
            if node.op_type in RECURRENT_OPS:
                two = attr(node, "direction", b"forward") == b"bidirectional"
                for slot, out in enumerate(node.output):
                    self.recurrent[out] = _recurrent_views(slot, 1 + two)

    def views(self, name, dims):
        """`((name, label), dims)` for each way a Keras output can be read
        from tensor `name`: the tensor itself (label `""`), and for an
        output of a recurrent op one direction, its steps in reverse or
        the two directions merged (`_recurrent_views`; their shapes
        left to the values, dims None)."""
        views = self.recurrent.get(name, [("", None)])
        return [
            ((name, label), dims if not label else None) for label, _ in views
        ]

    def view(self, name, label, value):
        """`value` of tensor `name` read as `label` (see `views`)."""
        if not label:
            return value
        return dict(self.recurrent[name])[label](value)

    def float_outputs(self, scope):
        """The float tensors the scope's nodes produce, last first."""
        found = []
        for node in reversed(self.groups.get(scope, [])):
            for out in node.output:
                elem, shape = self.types.get(out, (None, None))
                if elem in FLOAT_TYPES:
                    found.append((out, shape))
        return found

    def recurrent_outputs(self, scope):
        """The float outputs of the recurrent ops in the scope's group."""
        return [
            (out, self.types[out][1])
            for node in self.groups.get(scope, [])
            if node.op_type in RECURRENT_OPS
            for out in node.output
            if self.types.get(out, (None,))[0] in FLOAT_TYPES
        ]

    def activation_dqs(self, scope):
        """The activation DequantizeLinears among the scope's nodes."""
        return [
            n.output[0]
            for n in self.groups.get(scope, [])
            if n.op_type == "DequantizeLinear"
            and n.input[0] not in self.initializers
        ]

    def feeding_dqs(self, scope):
        """The activation DequantizeLinears outside the scope that its
        nodes read: a Q/DQ tf2onnx merged with an equal one of another
        consumer of the same tensor, named after that consumer."""
        own = {id(n) for n in self.groups.get(scope, [])}
        found = []
        for node in self.groups.get(scope, []):
            for name in node.input:
                producer = self._producer_dq(name)
                if producer is not None and id(producer) not in own:
                    found.append(producer.output[0])
        return list(dict.fromkeys(found))

    def _producer_dq(self, tensor):
        return self._dq_by_output.get(tensor)

    def dq_scale(self, dq):
        """(scale, relative precision) of the DequantizeLinear with output
        `dq` when its scale is one constant, else None."""
        node = self._dq_by_output.get(dq)
        return None if node is None else self._scales.get(node.input[1])


def _scalar_scales(proto):
    """(value, relative precision) of each one-value float initializer,
    by name: the scales a per-tensor DequantizeLinear reads."""
    from onnx import numpy_helper

    found = {}
    for init in proto.graph.initializer:
        if init.data_type not in FLOAT_TYPES or math.prod(init.dims) != 1:
            continue
        value = numpy_helper.to_array(init)
        found[init.name] = (float(value.reshape(())), np.finfo(value.dtype).eps)
    return found


def run(proto, graph, tensors, inputs):
    """ONNX Runtime's values of `tensors`, made outputs of a copy of
    `proto` (`onnx.reference`'s for a graph ONNX Runtime cannot run)."""
    import tempfile

    onnx = optional_import("onnx")
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    del copy.graph.output[:]
    for name in tensors:
        elem, _ = graph.types[name]
        copy.graph.output.append(
            onnx.helper.make_tensor_value_info(name, elem, None)
        )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "compare.onnx")
        onnx.save(copy, path)
        session = (
            ReferenceSession(path)
            if reference_only(copy)
            else ort_session(path, optimized=False)
        )
        outs = run_session(session, inputs)
    return dict(zip(tensors, outs))

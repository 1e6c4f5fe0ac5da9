"""The ONNX side of `compare_onnx`: the graph's tensors by name scope,
the layouts a Keras output can take in it, and ONNX Runtime's values of
any of its tensors."""

import itertools
import math
import os

import numpy as np

from keras_mp._compat import optional_import
from keras_mp.onnx.parity import ort_session, run_session

FLOAT_TYPES = (1, 10, 11)  # onnx.TensorProto FLOAT, FLOAT16, DOUBLE


def fits(shape, want):
    """Whether an ONNX static shape can hold a Keras output shape: the same
    axes in any order (NCHW after tf2onnx's transpose optimizer, say), with
    size-1 axes left out, or the batch merged with the leading axes (a
    MatMul on `(batch * tokens, features)`)."""
    if shape is None:
        return True
    if len(shape) == len(want) and all(
        a is None or a in want[1:] for a in shape[1:]
    ):
        return True
    if [d for d in shape[1:] if d != 1] == [d for d in want[1:] if d != 1]:
        return True
    known = [d for d in shape[1:] if d is not None]
    return (
        len(known) == len(shape) - 1
        and math.prod(want[1:]) % max(math.prod(known), 1) == 0
    )


def _layouts(got, want):
    """`got` brought to `want`'s shape every way that keeps the values: its
    non-batch axes permuted (NCHW, a transposed attention matrix), or
    reshaped when it holds the same number of values."""
    options = []
    rest = range(1, got.ndim)
    if got.ndim == want.ndim:
        for order in itertools.permutations(rest):
            if tuple(got.shape[i] for i in order) == want.shape[1:]:
                options.append(np.transpose(got, (0, *order)))
    if not options and got.size == want.size:
        options.append(got.reshape(want.shape))
    return options


def error(got, want):
    """(max abs, rel L2) with `got` brought to `want`'s layout, the best
    over the layouts that fit (`_layouts`); None when none does."""
    best = None
    norm = max(float(np.linalg.norm(want)), 1e-12)
    for g in _layouts(got, want):
        diff = np.abs(g.astype(np.float64) - want)
        err = (float(diff.max()), float(np.linalg.norm(diff)) / norm)
        best = err if best is None or err[1] < best[1] else best
    return best


class Graph:
    """The ONNX graph's tensor types, and its nodes grouped by every name
    scope their names (or their outputs' names) lie in: a layer's group
    holds the nodes of the layers inside it too."""

    def __init__(self, proto):
        onnx = optional_import("onnx")
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
        self.groups = {}
        for node in proto.graph.node:
            scopes = set()
            for name in (node.name, *node.output):
                parts = name.split("/")
                scopes.update("/".join(parts[:k]) for k in range(1, len(parts)))
            for scope in scopes:
                self.groups.setdefault(scope, []).append(node)

    def float_outputs(self, scope):
        """The float tensors the scope's nodes produce, last first."""
        found = []
        for node in reversed(self.groups.get(scope, [])):
            for out in node.output:
                elem, shape = self.types.get(out, (None, None))
                if elem in FLOAT_TYPES:
                    found.append((out, shape))
        return found

    def activation_dqs(self, scope):
        return [
            n.output[0]
            for n in self.groups.get(scope, [])
            if n.op_type == "DequantizeLinear"
            and n.input[0] not in self.initializers
        ]


def run(proto, graph, tensors, inputs):
    """ONNX Runtime's values of `tensors`, made outputs of a copy of
    `proto`."""
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
        outs = run_session(ort_session(path, optimized=False), inputs)
    return dict(zip(tensors, outs))

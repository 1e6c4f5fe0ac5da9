"""The probe of op-level quantization (`op_sites.py`): one run of the model
on zeros that records, for each candidate layer, the GEMM calls of its own
code (the op, its source location and occurrence, each operand's role)
and counts the calls of every selected layer.

A *weight* operand is one of the layer's variables or a tensor moved from
one by an op of `op_sites.MOVES`; *probs* a softmax output (of
`ops.softmax` or of Keras' `Softmax` layer, recognized by value); an
*input* any other float operand, marked `same` when it is the very tensor
an earlier site of the layer read. Integer and symbolic operands have no
role.
"""

import keras
import numpy as np

from keras_mp.quantization.op_sites import (
    MOVES,
    _bind,
    _is_float,
    _state,
    install,
)


def weight_axes(name, equation, index, shape):
    """The output-channel axes of a weight operand: the axes that reach the
    op's output and no other operand (an einsum's), or a matmul operand's
    non-contracted matrix axis; `()` (per tensor) when there is none.

    Batch axes (an expert axis `e` in `"btef,efd->bted"`, a matmul's
    leading axes) share the ranges: ONNX's DequantizeLinear scales vary
    along one axis only, so per-expert-and-channel ranges could not be
    exported; each output channel's range covers every expert."""
    rank = len(shape)
    if name == "matmul":
        if rank < 2:
            return ()
        return (rank - 1,) if index == 1 else (rank - 2,)
    inputs, _, output = equation.replace(" ", "").partition("->")
    subscripts = inputs.split(",")
    if not output:  # implicit output: the labels used once, sorted
        letters = "".join(subscripts)
        output = "".join(sorted(c for c in letters if letters.count(c) == 1))
    labels = subscripts[index]
    if "." in labels:
        return ()
    others = "".join(s for i, s in enumerate(subscripts) if i != index)
    axes = tuple(
        i for i, c in enumerate(labels) if c in output and c not in others
    )
    return () if len(axes) == len(labels) else axes


def gemm_size(shape, axes):
    """`(K, N)` of a weight operand: the product of its contracted axes and
    of its output axes."""
    n = int(np.prod([shape[a] for a in axes])) if axes else 1
    k = int(np.prod(shape)) // max(n, 1)
    return k, n


class Probe:
    """Records the GEMM sites of `layers` during one call of the model."""

    def __init__(self, layers):
        self.counts = {}  # id(layer) -> calls, of every probed layer
        self.variables = {
            id(layer): {id(v) for v in layer.weights} for layer in layers
        }
        self.sites = {}  # id(layer) -> list of sites of its first call
        self.calls = {}  # id(layer) -> sites of the call running now
        self.changed = {}  # id(layer) -> message when calls differ
        self.tags = {}  # id(tensor) -> ("weight", id(layer)) or ("probs",)
        self.alive = []  # tensors tagged, kept so that ids stay unique
        # softmax outputs by value: a `keras.layers.Softmax` returns a new
        # tensor object holding the values `ops.softmax` computed
        self.softmax_values = set()

    def begin(self, layer):
        if id(layer) in self.variables:
            self.calls[id(layer)] = {}  # where -> occurrences in this call
            self.sites.setdefault(id(layer), [])

    def end(self, layer):
        self.calls.pop(id(layer), None)

    def _tag(self, tensor, tag):
        self.tags[id(tensor)] = tag
        self.alive.append(tensor)
        if tag == ("probs",):
            self.softmax_values.add(_fingerprint(tensor))
        return tensor

    def tag_probs(self, tensor):
        return self._tag(tensor, ("probs",))

    def _weight_of(self, x, owner):
        if id(x) in self.variables.get(id(owner), ()):
            return True
        return self.tags.get(id(x)) == ("weight", id(owner))

    def record(self, owner, name, op, args, kwargs, where):
        out = op(*args, **kwargs)
        if name == "softmax":
            return self._tag(out, ("probs",))
        if name in MOVES:
            source = args[0] if args else next(iter(kwargs.values()))
            tag = self.tags.get(id(source))
            for layer_id, variables in self.variables.items():
                if id(source) in variables:
                    tag = ("weight", layer_id)
            return out if tag is None else self._tag(out, tag)
        seen_here = self.calls.get(id(owner))
        if seen_here is None:  # not a candidate's own code
            return out
        sites = self.sites[id(owner)]
        occurrence = seen_here.get(where, 0)
        seen_here[where] = occurrence + 1
        operands, _ = _bind(name, op, args, kwargs)
        roles, refs = [], []
        for index, x in enumerate(operands):
            roles.append(self._role(owner, name, args, index, x, sites))
            refs.append(x)
        site = {
            "op": name,
            "where": where,
            "occurrence": occurrence,
            "operands": roles,
            "gemm": sums_over_something(
                name, args[0] if name == "einsum" else None
            )
            and not _outer_matmul(name, operands, roles),
        }
        known = next(
            (
                s
                for s in sites
                if (s["where"], s["occurrence"]) == (where, occurrence)
            ),
            None,
        )
        if known is None:
            site["_refs"] = refs
            sites.append(site)
        elif _shape_free(known) != _shape_free(site):
            self.changed[id(owner)] = (
                f"`ops.{name}` in {where} takes operands of other kinds in "
                "another call"
            )
        return out

    def _role(self, owner, name, args, index, x, sites):
        if not _is_float(x):
            return {"role": None}
        shape = [int(d) for d in x.shape]
        if self._weight_of(x, owner):
            equation = args[0] if name == "einsum" else None
            axes = weight_axes(name, equation, index, shape)
            return {"role": "weight", "axes": list(axes), "shape": shape}
        if (
            self.tags.get(id(x)) == ("probs",)
            or _fingerprint(x) in self.softmax_values
        ):
            return {"role": "probs", "shape": shape}
        if name != "dot_product_attention":
            for s, site in enumerate(sites):
                for i, ref in enumerate(site.get("_refs", ())):
                    if ref is x and site["operands"][i]["role"] == "input":
                        return {"role": "input", "same": [s, i]}
        return {"role": "input", "shape": shape}


def _fingerprint(x):
    """A tensor's dtype, shape and values, to recognize it again."""
    v = np.asarray(keras.ops.convert_to_numpy(x))
    return (str(v.dtype), v.shape, hash(v.tobytes()))


def sums_over_something(name, equation):
    """Whether an op contracts an axis (a GEMM): every matmul and attention
    does; an einsum whose labels all reach the output (an outer or
    elementwise product: positions times frequencies in a rotary
    embedding) does not."""
    if name != "einsum":
        return True
    inputs, arrow, output = equation.replace(" ", "").partition("->")
    subscripts = inputs.split(",")
    letters = "".join(subscripts).replace(".", "")
    if not arrow:
        output = "".join(c for c in letters if letters.count(c) == 1)
    return bool(set(letters) - set(output))


def _outer_matmul(name, operands, roles):
    """A matmul over an axis of size 1 between tensors none of which is a
    softmax output: an outer product (a rotary embedding's frequencies
    times positions, SmolLM3), no GEMM. (An attention's probs @ value sums
    over the sequence, which is 1 in the probe's call: its probs operand
    tells it apart.)"""
    if name != "matmul" or any(r.get("role") == "probs" for r in roles):
        return False
    shape = getattr(operands[0], "shape", None)
    return bool(shape) and len(shape) >= 1 and shape[-1] == 1


def _shape_free(site):
    """A site's op and operand roles, without shapes (a shared layer's
    calls may see other batch or sequence sizes)."""
    return (site["op"], [spec["role"] for spec in site["operands"]])


def probe(run, layers, site_layers, targets=None):
    """Runs `run()` (the model on zeros) counting the calls of each of
    `layers` and recording the op sites of each of `site_layers`: the one
    probe of quantization (`recipe`) and MuPPET (`muppet.model`).

    Args:
        run: callable running the model once.
        layers: the layers whose calls are counted.
        site_layers: the layers whose own GEMM calls are recorded.
        targets: `{id(tensor): input index}` of the model inputs to look
            for among the tensors each of `layers` is called on, or None.

    Returns:
        `(sites, changed, calls, received)`: `{id(layer): [site, ...]}`,
        `{id(layer): message}` naming layers whose calls differ,
        `{id(layer): number of calls}` (a wrapper calling a layer's `call`
        once per time step, as `TimeDistributed` does, counts once), and
        `{id(layer): {(position, input index), ...}}`: where in its
        flattened positional arguments a layer received a model input of
        `targets` unchanged.
    """
    received = {}
    install()
    state = _state()
    recorder = Probe(site_layers)
    counts = recorder.counts
    inside = set()  # layers in their own __call__
    originals = [
        (layer, type(layer))
        for layer in {id(x): x for x in [*layers, *site_layers]}.values()
    ]

    def probe_class(cls):
        def __call__(self, *args, **kwargs):
            counts[id(self)] = counts.get(id(self), 0) + 1
            for position, t in enumerate(keras.tree.flatten(args)):
                if targets and id(t) in targets:
                    received.setdefault(id(self), set()).add(
                        (position, targets[id(t)])
                    )
            inside.add(id(self))
            recorder.begin(self)
            try:
                return cls.__call__(self, *args, **kwargs)
            finally:
                recorder.end(self)
                inside.discard(id(self))

        def call(self, *args, **kwargs):
            # a wrapper calling `layer.call` itself (TimeDistributed)
            if id(self) in inside:
                return cls.call(self, *args, **kwargs)
            counts.setdefault(id(self), 1)
            recorder.begin(self)
            try:
                return cls.call(self, *args, **kwargs)
            finally:
                recorder.end(self)

        return type(cls.__name__, (cls,), {"__call__": __call__, "call": call})

    classes = {}
    softmax_call = keras.layers.Softmax.call

    def tagged_softmax(self, *args, **kwargs):
        # the masked softmax of keras' layer: a softmax output too
        return recorder.tag_probs(softmax_call(self, *args, **kwargs))

    try:
        for layer, cls in originals:
            if cls not in classes:
                classes[cls] = probe_class(cls)
            object.__setattr__(layer, "__class__", classes[cls])
        keras.layers.Softmax.call = tagged_softmax
        state.probe = recorder
        run()
    finally:
        state.probe = None
        keras.layers.Softmax.call = softmax_call
        for layer, cls in originals:
            object.__setattr__(layer, "__class__", cls)
    for sites in recorder.sites.values():
        for site in sites:
            site.pop("_refs", None)
    return recorder.sites, recorder.changed, counts, received

"""Channel permutations that let m:n pruning keep more weight magnitude:
`search_permutation` for one kernel, `permute_for_sparsity` for a model.
The method: `docs/sparsity.md`."""

import dataclasses
import warnings

import keras
import numpy as np

from keras_mp import _keras, _models, layer_table
from keras_mp.layer_table import CHANNELWISE, CONSUMER, GEMM, Verdict
from keras_mp.selection import layer_matcher
from keras_mp.sparsity.masks import (
    SparsityMask,
    check_axis,
    check_m_n,
    value,
)
from keras_mp.sparsity.model import check_eligible

# Entries of the temporary (rows, channels, columns) array per chunk.
_CHUNK_ELEMENTS = 1 << 22


@dataclasses.dataclass
class ChannelPermutation:
    """What `search_permutation` found for one kernel.

    Attributes:
        permutation: int array. New input channel `i` is old channel
            `permutation[i]`: `np.take(kernel, permutation, axis)`.
        kept_magnitude: float. Share of sum |w| that m:n magnitude pruning
            keeps in the original channel order.
        kept_magnitude_permuted: float. The same share after permuting.
        swaps: int. Channel swaps the search made.
    """

    permutation: np.ndarray
    kept_magnitude: float
    kept_magnitude_permuted: float
    swaps: int


def _matrix(kernel, axis):
    """|kernel| as a float64 `(channels, rest)` matrix."""
    w = np.abs(np.asarray(kernel, dtype=np.float64))
    check_axis(w.shape, axis)
    return np.moveaxis(w, axis, 0).reshape(w.shape[axis], -1)


def _kept(w, m, n):
    """Sum of the `m` largest of every group of `n` rows of `w` (C, K)."""
    groups = np.sort(w.reshape(-1, n, w.shape[1]), axis=1)
    return groups[:, n - m :].sum()


def _rest(w, perm, position, m, n):
    """Top-m sum and m-th largest of a group without one of its channels."""
    start = position - position % n
    others = [p for p in range(start, start + n) if p != position]
    rest = np.sort(w[perm[others]], axis=0)[::-1]
    return rest[:m].sum(), rest[m - 1]


def search_permutation(kernel, axis, m=2, n=4, max_swaps=None):
    """Searches an input-channel order that m:n pruning loses less of.

    Greedy channel-swap search (Pool & Yu 2021): starting from the
    original order, repeatedly make the swap of two channels in different
    groups that most increases the |w| that m:n magnitude pruning keeps,
    until no swap helps. Deterministic. It keeps a table of every swap's
    gain and updates the rows a swap touches, so the time grows about as
    `channels * kernel.size`.

    Args:
        kernel: array-like. A layer kernel.
        axis: int. Its input-channel axis (`in_axis` of the layer's
            `keras_mp.layer_table.prunable_weight`).
        m: int. Weights kept per group. Defaults to 2.
        n: int. Group size. Defaults to 4.
        max_swaps: int. Stop after this many swaps. Defaults to None: run
            until no swap improves.

    Returns:
        A `ChannelPermutation`.

    Raises:
        ValueError: bad `m`/`n`/`axis`, or channels not a multiple of `n`.

    Example:

    >>> w = np.array([9.0, 8.0, 7.0, 1.0, 6.0, 1.0, 1.0, 1.0])[:, None]
    >>> found = search_permutation(w, axis=0)
    >>> round(found.kept_magnitude, 3), round(found.kept_magnitude_permuted, 3)
    (0.706, 0.882)
    """
    check_m_n(m, n)
    w = _matrix(kernel, axis)
    channels = w.shape[0]
    if channels % n:
        raise ValueError(
            f"The kernel has {channels} input channels on axis {axis}, not a "
            f"multiple of n={n}: no m:n groups to permute."
        )
    perm = np.arange(channels)
    total = w.sum()
    before = _kept(w, m, n)
    if not total or channels == n or max_swaps == 0:
        ratio = float(before / total) if total else 1.0
        return ChannelPermutation(perm, ratio, ratio, 0)
    group = np.arange(channels) // n
    same = group[:, None] == group[None, :]
    # replace[p, q]: kept |w| of p's group with the channel at position q
    # in place of p's; only the groups (and columns) a swap touches change.
    top = np.empty(channels)
    mth = np.empty_like(w)
    replace = np.empty((channels, channels))

    def refresh_rows(rows):
        for p in rows:
            top[p], mth[p] = _rest(w, perm, p, m, n)
        ordered = w[perm]
        size = max(1, _CHUNK_ELEMENTS // ordered.size)
        for i in range(0, len(rows), size):
            chunk = rows[i : i + size]
            gain = np.maximum(ordered[None] - mth[chunk][:, None], 0.0)
            replace[chunk] = top[chunk][:, None] + gain.sum(-1)

    def refresh_column(q):
        gain = np.maximum(w[perm[q]][None] - mth, 0.0)
        replace[:, q] = top + gain.sum(-1)

    refresh_rows(list(range(channels)))
    score = np.diagonal(replace).copy()  # a channel replacing itself
    tolerance = 1e-9 * total
    swaps = 0
    while max_swaps is None or swaps < max_swaps:
        gain = replace + replace.T - score[:, None] - score[None, :]
        gain[same] = -np.inf
        p, q = np.unravel_index(np.argmax(gain), gain.shape)
        if gain[p, q] <= tolerance:
            break
        perm[p], perm[q] = perm[q], perm[p]
        swaps += 1
        touched = [i for i in range(channels) if group[i] in (p // n, q // n)]
        refresh_rows(touched)
        refresh_column(p)
        refresh_column(q)
        score[touched] = np.diagonal(replace)[touched]
    after = _kept(w[perm], m, n)
    return ChannelPermutation(
        perm, float(before / total), float(after / total), swaps
    )


@dataclasses.dataclass
class LayerPermutation:
    """One row of what `permute_for_sparsity` did.

    Attributes:
        name: str. The layer whose input channels were (to be) permuted.
        producer: str or None. The layer whose output channels follow.
        between: list of str. Channel-wise layers in between (BatchNorm
            parameters among them are permuted too).
        permuted: bool. The weights were permuted.
        reason: str or None. Why not, when not.
        kept_magnitude: float or None. Share of sum |w| that m:n pruning
            keeps in the original channel order.
        kept_magnitude_permuted: float or None. The same after permuting.
        permutation: list of int or None. New channel i is old channel
            `permutation[i]`.
    """

    name: str
    producer: str = None
    between: list = dataclasses.field(default_factory=list)
    permuted: bool = False
    reason: str = None
    kept_magnitude: float = None
    kept_magnitude_permuted: float = None
    permutation: list = None


def _channels_last(layer):
    return getattr(layer, "data_format", "channels_last") == "channels_last"


def _role(layer):
    """`layer`'s channel-permutation role in the layer table, or ""."""
    row = layer_table.row_for(layer)
    return row.permute if row is not None else ""


def _plain(layer):
    """A Dense or ConvND layer whose kernel and channels can be reordered."""
    return (
        _role(layer) == GEMM
        and getattr(layer, "groups", 1) == 1
        and _channels_last(layer)
        and not getattr(layer, "lora_enabled", False)
    )


def _channelwise(layer):
    if _role(layer) != CHANNELWISE:
        return False
    if isinstance(layer, keras.layers.BatchNormalization):
        return layer.axis in (-1, len(layer.input.shape) - 1)
    return _channels_last(layer)


def _graph(model):
    """`(graph, nodes, consumers, outputs)` of a Functional graph."""
    graph = _keras.functional_graph(model)
    if graph is None:
        raise ValueError(
            f"Sequential model {model.name!r} has no known input shape: "
            "start it with keras.Input(shape) so its graph exists."
        )
    nodes, consumers = {}, {}
    for level in _keras.nodes_by_depth(graph):
        for node in level:
            nodes.setdefault(id(node.operation), []).append(node)
            for tensor in node.input_tensors:
                consumers.setdefault(id(tensor), []).append(node.operation)
    outputs = {id(t) for t in graph.outputs}
    return graph, nodes, consumers, outputs


def _chain(node, nodes, consumers, outputs):
    """`Verdict` of `(producer, between)` feeding `node`'s layer."""
    between = []
    while True:
        if len(node.input_tensors) != 1:
            return Verdict(reason=f"{node.operation.name} has several inputs")
        tensor = node.input_tensors[0]
        layer, index, _ = _keras.keras_history(tensor)
        readers = consumers.get(id(tensor), [])
        if id(tensor) in outputs or len(readers) != 1:
            others = sorted({r.name for r in readers} - {node.operation.name})
            return Verdict(
                reason=f"the output of {layer.name} also goes to "
                + (
                    "the model outputs"
                    if id(tensor) in outputs
                    else ", ".join(others)
                )
            )
        if isinstance(layer, keras.layers.InputLayer):
            return Verdict(reason="its input is a model input")
        if len(nodes.get(id(layer), ())) != 1:
            return Verdict(reason=f"{layer.name} is called more than once")
        if _channelwise(layer):
            between.append(layer)
            node = _keras.inbound_nodes(layer)[index]
            continue
        if not _plain(layer):
            return Verdict(
                reason=f"its input comes from {layer.name} "
                f"({type(layer).__name__}), not through channel-wise layers "
                "from a Dense or ConvND layer"
            )
        return Verdict((layer, between[::-1]))


def _take(variable, perm, axis):
    """Permutes a variable (and its SparsityMask, if any) along `axis`."""
    variable.assign(np.take(value(variable), perm, axis=axis))
    constraint = getattr(variable, "constraint", None)
    if isinstance(constraint, SparsityMask):
        constraint.mask.assign(np.take(value(constraint.mask), perm, axis))


def _producer_chain(layer, nodes, consumers, outputs):
    """`Verdict` of `(producer, between)` for a layer's inputs."""
    transpose = _role(layer) == CONSUMER and _channels_last(layer)
    if not (_plain(layer) or transpose):
        return Verdict(
            reason=f"permuting the inputs of a {type(layer).__name__} is not "
            "supported (Dense, ConvND and ConvNDTranspose without groups, "
            "LoRA or channels_first are)"
        )
    if len(nodes[id(layer)]) != 1:
        return Verdict(reason=f"{layer.name} is called more than once")
    return _chain(nodes[id(layer)][0], nodes, consumers, outputs)


def _permute_graph(model, m, n, selected, max_swaps, rows, covered):
    """Permutes where a Functional graph shows the producer; nested graph
    models are entered, each with its own graph. Appends to `rows`, adds
    the layers it decided on to `covered` (ids)."""
    graph, nodes, consumers, outputs = _graph(model)
    for layer in graph.operations:
        if _keras.is_graph_model(layer):
            _permute_graph(layer, m, n, selected, max_swaps, rows, covered)
            continue
        if not selected(layer) or not layer_table.prunable_weight(layer).ok:
            continue
        covered.add(id(layer))
        row = LayerPermutation(layer.name)
        rows.append(row)
        verdict = check_eligible(layer, m, n)
        if not verdict.ok:
            row.reason = verdict.reason
            continue
        axis = verdict.value.in_axis
        kernel = getattr(layer, verdict.value.attr)
        constraint = getattr(kernel, "constraint", None)
        if isinstance(constraint, SparsityMask) and constraint.pruned:
            raise ValueError(
                f"Layer {layer.name} is already pruned to "
                f"{constraint.m}:{constraint.n}; call "
                "permute_for_sparsity before StructuredSparsity prunes."
            )
        chain = _producer_chain(layer, nodes, consumers, outputs)
        if not chain.ok:
            row.reason = chain.reason
            found = search_permutation(value(kernel), axis, m, n, 0)
            row.kept_magnitude = found.kept_magnitude
            continue
        found = search_permutation(value(kernel), axis, m, n, max_swaps)
        row.kept_magnitude = found.kept_magnitude
        producer, between = chain.value
        row.producer = producer.name
        row.between = [b.name for b in between]
        row.kept_magnitude_permuted = found.kept_magnitude_permuted
        row.permutation = found.permutation.tolist()
        if found.swaps == 0:
            continue
        perm = found.permutation
        _take(kernel, perm, axis)
        _take(producer.kernel, perm, -1)
        if getattr(producer, "bias", None) is not None:
            _take(producer.bias, perm, 0)
        for layer_between in between:
            for variable in layer_between.weights:
                _take(variable, perm, 0)
        row.permuted = True


def permute_for_sparsity(model, m=2, n=4, layers=None, max_swaps=None):
    """Reorders channels in place so m:n pruning keeps more |w|.

    For each prunable layer, `search_permutation` finds an order of its
    input channels that keeps more weight magnitude under m:n magnitude
    pruning. The layer's kernel is permuted along its input-channel axis and
    the producing layer's kernel and bias along their output channels, with
    the parameters of any BatchNormalization in between, so the model
    computes the same function. This is done where the producer is a
    simple chain: Dense or ConvND, then channel-wise layers only
    (BatchNormalization, activations, Dropout, pooling), each with this
    one consumer, in the layer graph of a Sequential or Functional model
    (nested ones and keras-hub backbones included). Other layers are left
    alone, with the reason in the returned rows: among them every layer
    inside a custom layer or a subclassed model, whose producer is Python
    code, not a graph. Call it after dense training and before
    `StructuredSparsity` prunes, then compile with a fresh optimizer: the
    per-weight state of an optimizer that already ran (e.g. Adam moments)
    is not permuted.

    Args:
        model: a built `keras.Model`.
        m: int. Weights kept per group. Defaults to 2.
        n: int. Group size. Defaults to 4.
        layers: optional selection of the layers whose inputs to permute,
            as in `StructuredSparsity`. Defaults to None: every layer.
        max_swaps: int. Per-layer bound for `search_permutation`.
            Defaults to None (search until no swap helps).

    Returns:
        A list of `LayerPermutation`, one per selected layer type that
        `StructuredSparsity` supports: the graph's layers in graph order,
        then those no graph reaches, in layer-tracking order.

    Raises:
        TypeError: `model` is not a Keras 3 model.
        ValueError: bad `m`/`n`, a Sequential model without an input
            shape, or a layer that `StructuredSparsity` has already pruned
            (permute first).

    Example:

    >>> model.fit(x, y, epochs=3)  # doctest: +SKIP
    >>> rows = keras_mp.permute_for_sparsity(model)  # doctest: +SKIP
    >>> model.compile(...)  # doctest: +SKIP
    >>> sparsity = keras_mp.StructuredSparsity()  # doctest: +SKIP
    >>> model.fit(x, y, callbacks=[sparsity])  # doctest: +SKIP
    """
    _models.check_model(model, "permute_for_sparsity")
    check_m_n(m, n)
    optimizer = getattr(model, "optimizer", None)
    # A built optimizer that never stepped (e.g. `clone_model` of a compiled
    # model) holds only its initial state: nothing to permute.
    if (
        optimizer is not None
        and optimizer.built
        and int(_keras.to_numpy(optimizer.iterations)) > 0
    ):
        warnings.warn(
            "permute_for_sparsity: the optimizer of this model has state "
            "that is not permuted; compile with a fresh optimizer before "
            "the sparse fine-tune.",
            stacklevel=2,
        )
    selected = layer_matcher(layers)
    rows = []
    covered = set()
    if _keras.is_graph_model(model):
        _permute_graph(model, m, n, selected, max_swaps, rows, covered)
    # What no layer graph reaches: layers inside custom layers (keras-hub's
    # transformer blocks) or a subclassed model, called by Python code.
    for layer, parents in _models.walk_layers(model, with_parents=True):
        if id(layer) in covered or not selected(layer):
            continue
        if not layer_table.prunable_weight(layer).ok:
            continue
        owner = parents[-1] if parents else model
        row = LayerPermutation(layer.name)
        rows.append(row)
        verdict = check_eligible(layer, m, n)
        row.reason = verdict.reason or (
            f"it is called by the code of {owner.name} "
            f"({type(owner).__name__}), not in a layer graph: its producer "
            "is unknown"
        )
        if verdict.ok:
            kernel = getattr(layer, verdict.value.attr)
            axis = verdict.value.in_axis
            found = search_permutation(value(kernel), axis, m, n, 0)
            row.kept_magnitude = found.kept_magnitude
    return rows

"""The data a model takes, checked against its inputs: one array, a list of
arrays (several inputs) or a dict by input name, each keeping the dtype of
its Keras input (integer token ids stay integers), and `batches`, the one
iterator over user data. Shared by `calibrate`, `layer_sensitivity`,
`auto_quantize`, `verify_onnx` and `export_onnx`."""

import dataclasses

import numpy as np

from keras_mp import _keras


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One model input: its Keras name, shape (batch first) and dtype, and
    the model's name (for messages)."""

    name: str
    shape: tuple
    dtype: str
    model: str


def input_specs(model, what, error=ValueError):
    """The model's inputs as `InputSpec`s, or None for a subclassed model.

    Raises:
        error: the model has never been called (no known inputs).
    """
    try:
        inputs = model.inputs if model.built else None
    except AttributeError:  # subclassed: no symbolic inputs
        return None
    if not inputs:
        raise error(
            f"Model {model.name!r} has never been called, so its inputs are "
            f"unknown to {what}. Build it with `keras.Input(...)` or call it "
            "once on a batch first."
        )
    return [
        InputSpec(name, tuple(t.shape), np.dtype(t.dtype).name, model.name)
        for name, t in zip(_keras.input_names(model), inputs)
    ]


def _convert(x, spec, what, error):
    x = np.asarray(x)
    want = np.dtype(spec.dtype)
    if want.kind in "iub" and x.dtype.kind not in "iub":
        raise error(
            f"{what}: input {spec.name!r} of model {spec.model!r} is "
            f"{spec.dtype} (token ids, masks, indices), but the data for it "
            f"is {x.dtype}. Pass integer "
            f"arrays for it (e.g. `x.astype('{spec.dtype}')`)."
        )
    if x.ndim == 0 or len(x) == 0:
        raise error(f"{what} is empty: pass some real inputs.")
    expected = spec.shape
    if x.ndim != len(expected) or any(
        e is not None and e != s for e, s in zip(expected[1:], x.shape[1:])
    ):
        raise error(
            f"{what}: input {spec.name!r} has shape {x.shape}, but model "
            f"{spec.model!r} expects {expected} (None: any size). Pass "
            "inputs shaped like the model's, batch first."
        )
    return x.astype(want, copy=False)


def as_input_list(data, specs, what, error=ValueError):
    """One batch (an array, a list of arrays or a dict by input name) as a
    list of NumPy arrays in `specs` order, each cast to its input's dtype.

    Args:
        data: the batch.
        specs: list of `InputSpec` (`input_specs`), or None (a subclassed
            model: one input, the data's own dtype, float64 as float32).
        what: str. What the data is, for messages (e.g. "`verify_data`").
        error: the exception class to raise.

    Raises:
        error: a dict with a missing or extra key, the wrong number of
            arrays, a shape or dtype the input does not take, different
            batch sizes.
    """
    if specs is None:
        x = np.asarray(data)
        return [x.astype(np.float32) if x.dtype == np.float64 else x]
    names = [s.name for s in specs]
    if isinstance(data, dict):
        missing = [n for n in names if n not in data]
        extra = sorted(str(k) for k in data if k not in names)
        if missing or extra:
            raise error(
                f"{what} is a dict with keys {sorted(map(str, data))}, but "
                f"model {specs[0].model!r} has inputs {names} (missing: "
                f"{missing}, unexpected: {extra}). Give exactly one array per "
                "input name."
            )
        data = [data[n] for n in names]
    elif not isinstance(data, (list, tuple)):
        data = [data]
    if len(data) != len(specs):
        raise error(
            f"{what} holds {len(data)} array(s), but model "
            f"{specs[0].model!r} has "
            f"{len(specs)} input(s) {names}: pass a list in that order or a "
            "dict by input name, one array per input."
        )
    arrays = [_convert(x, s, what, error) for x, s in zip(data, specs)]
    if len({len(x) for x in arrays}) > 1:
        raise error(
            f"{what} arrays have different batch sizes "
            f"{[len(x) for x in arrays]}: give every input the same number "
            "of samples."
        )
    return arrays


def strip_labels(batch, n):
    """A dataset / iterable element for a model of `n` inputs without its
    labels, as NumPy: `(x, y)`, `(x,)` and `((x1, x2), y)` give `x`."""
    import keras

    if isinstance(batch, (tuple, list)):
        first = batch[0]
        if isinstance(first, (tuple, list, dict)) or n == 1:
            return strip_labels(first, n)
        return [keras.ops.convert_to_numpy(b) for b in batch[:n]]
    if isinstance(batch, dict):
        return {k: keras.ops.convert_to_numpy(v) for k, v in batch.items()}
    return keras.ops.convert_to_numpy(batch)


def batches(data, specs, caller, batch_size, num_batches=None, labels=None):
    """Yields `(inputs, labels or None)` pairs from user data, `inputs` a
    list of arrays (one per model input, each of its input's dtype), at
    most `num_batches` of them (None: all).

    Args:
        data: an array (a list or dict of arrays for a model of several
            inputs), cut into batches of `batch_size`; or a
            `tf.data.Dataset` / iterable of batches, whose `(x, y)`
            elements give their labels.
        specs: list of `InputSpec` (`input_specs`), or None.
        caller: str. The public function's name, for messages.
        batch_size: int. For array data.
        num_batches: int or None.
        labels: array of labels, one per sample of array `data`, or None.

    Raises:
        ValueError: `labels` of another length than the data, `labels`
            with a dataset, an empty dataset, or what `as_input_list`
            refuses.
        TypeError: `data` of another kind.
    """
    import keras

    n = 1 if specs is None else len(specs)
    arrays = None
    if isinstance(data, (np.ndarray, dict)) or (
        n > 1
        and isinstance(data, (list, tuple))
        and all(isinstance(a, np.ndarray) and a.ndim >= 1 for a in data)
    ):
        arrays = as_input_list(data, specs, f"`{caller}` data")
    if arrays is not None:
        total = len(arrays[0])
        if labels is not None:
            y = np.asarray(labels)
            if y.ndim == 0 or len(y) != total:
                raise ValueError(
                    f"`{caller}`: {total} samples in `data` but "
                    f"{'no' if y.ndim == 0 else len(y)} labels. Give one "
                    "label per sample."
                )
        for i, start in enumerate(range(0, total, batch_size)):
            if num_batches is not None and i >= num_batches:
                return
            stop = start + batch_size
            yield (
                [a[start:stop] for a in arrays],
                None if labels is None else y[start:stop],
            )
        return
    if labels is not None:
        raise ValueError(
            f"`{caller}`: `labels` go with array data. A dataset or an "
            "iterable gives its labels in its `(x, y)` batches."
        )
    if isinstance(data, (str, bytes)) or not hasattr(data, "__iter__"):
        raise TypeError(
            f"`{caller}`: `data` must be a NumPy array, a tf.data.Dataset or "
            "an iterable of batches (for several inputs: a list or dict of "
            f"arrays). Received: {type(data).__name__}"
        )
    found = 0
    for batch in data:
        if num_batches is not None and found >= num_batches:
            return
        y = None
        if (
            isinstance(batch, (tuple, list))
            and len(batch) == 2
            and (n == 1 or isinstance(batch[0], (tuple, list, dict)))
        ):
            y = keras.ops.convert_to_numpy(batch[1])
        x = strip_labels(batch, n)
        yield as_input_list(x, specs, f"`{caller}` batch"), y
        found += 1
    if found == 0:
        raise ValueError(f"`{caller}` data is empty: pass some real inputs.")


def call_arg(model, arrays, specs):
    """What to call `model` with: the one array, a dict by input name (a
    model built from a dict of inputs) or the list."""
    if len(arrays) == 1:
        return arrays[0]
    if _keras.inputs_are_dict(model):
        return {s.name: a for s, a in zip(specs, arrays)}
    return list(arrays)

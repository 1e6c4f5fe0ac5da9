"""Layer selection shared by quantization, sparsity and MuPPET."""

import re


def layer_matcher(selection):
    """Turns a selection into a test `f(layer) -> bool`.

    Args:
        selection: None (every layer), a layer name or regex (str, matched
            against the whole name), a compiled regex, a layer class, a
            callable `f(layer) -> bool`, or a list of these (any matches).

    Raises:
        TypeError: anything else.
    """
    if selection is None:
        return lambda layer: True
    if isinstance(selection, (list, tuple, set)):
        tests = [layer_matcher(s) for s in selection]
        return lambda layer: any(t(layer) for t in tests)
    if isinstance(selection, type):
        return lambda layer: isinstance(layer, selection)
    if isinstance(selection, re.Pattern):
        return lambda layer: bool(selection.fullmatch(layer.name))
    if isinstance(selection, str):
        pattern = re.compile(selection)
        return lambda layer: (
            layer.name == selection or bool(pattern.fullmatch(layer.name))
        )
    if callable(selection):
        return lambda layer: bool(selection(layer))
    raise TypeError(
        "`layers` selects layers by name or regex (str), class, callable "
        "`f(layer) -> bool`, or a list of these. Received: "
        f"{selection!r} of type {type(selection).__name__}"
    )

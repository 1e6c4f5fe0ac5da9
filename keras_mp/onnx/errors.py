"""The errors export raises."""


class ExportError(ValueError):
    """The model cannot be exported as asked; the message says why.

    Raised before anything is written: no file is left half-written.

    Example:

    >>> try:
    ...     keras_mp.export_onnx(qmodel, "model.onnx", opset=11)
    ... except keras_mp.ExportError as e:
    ...     print(e)  # what was wrong, and what to do
    """


class ParityError(ExportError):
    """ONNX Runtime's outputs differ from Keras' past the tolerance.

    Its message gives the figures and the tolerance;
    `keras_mp.compare_onnx` finds the first layer that diverges.

    Example:

    >>> try:
    ...     keras_mp.verify_onnx(qmodel, "model.onnx", x)
    ... except keras_mp.ParityError as e:
    ...     print(e)
    ...     print(keras_mp.compare_onnx(qmodel, "model.onnx", x[:8]))
    """

"""The errors export raises."""


class ExportError(ValueError):
    """The model cannot be exported as asked; the message says why."""


class ParityError(ExportError):
    """ONNX Runtime's outputs differ from Keras' past the tolerance."""

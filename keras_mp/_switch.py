"""A thread-local value set for the length of a `with` block: how the
ONNX trace (`formats.onnx_trace`) and the sensitivity probe
(`twins.probing`) reach every quantizer or twin without an argument
threaded through Keras' calls."""

import contextlib
import threading


class Switch:
    """A value, `default` outside any `with switch.set(value):` block.

    Thread-local: a `tf.distribute` replica thread or another thread of
    the user's sees its own value.
    """

    def __init__(self, default=None):
        self._local = threading.local()
        self._default = default

    @property
    def value(self):
        return getattr(self._local, "value", self._default)

    @contextlib.contextmanager
    def set(self, value):
        before = self.value
        self._local.value = value
        try:
            yield
        finally:
            self._local.value = before

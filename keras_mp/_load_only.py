"""Load-only classes: registered so that files saved by earlier keras_mp
releases load with `keras.saving.load_model`, never built by new code.

`LoadOnly` refuses construction outside Keras loading (its `from_config`)
with a `TypeError` that names what to use instead; `loading()` is the
scope loading runs in, which tests that write files of earlier releases
use too. The classes are listed in `keras_mp.legacy`.
"""

from keras_mp._switch import Switch

_LOADING = Switch(default=False)


def loading():
    """A `with` block in which load-only classes may be constructed.

    Keras loading runs their `from_config` inside one; code that writes a
    file the way an earlier release did (a test of `keras_mp.upgrade`)
    opens one itself.

    Example:

    >>> with keras_mp.legacy.loading():
    ...     old = keras_mp.legacy.QuantizeWrapper(keras.layers.Dense(4))
    """
    return _LOADING.set(True)


class LoadOnly:
    """Mixin of a load-only class: constructing it outside `loading()`
    raises a `TypeError` naming `REPLACEMENT`, what new code uses, and
    `HOME`, the module that lists it."""

    REPLACEMENT = ""
    HOME = "keras_mp.legacy"

    def __new__(cls, *args, **kwargs):
        if not _LOADING.value:
            raise TypeError(
                f"{cls.HOME}.{cls.__name__} is load-only: it is kept so "
                "that files saved by earlier keras_mp releases load with "
                f"`keras.saving.load_model`. {cls.REPLACEMENT} A model loaded "
                "from such a file: `model = keras_mp.upgrade(model)`."
            )
        return super().__new__(cls, *args, **kwargs)

    @classmethod
    def from_config(cls, config, *args, **kwargs):
        with loading():
            return super().from_config(config, *args, **kwargs)

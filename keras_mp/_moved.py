"""Old import paths of renamed modules, kept for one release.

`alias_modules(package, {old: new})` puts a stand-in module at
`package.old` in `sys.modules`: `import package.old` and
`from package.old import name` keep working, and reading a name from it
warns (`DeprecationWarning`, naming the new module) and returns the new
module's object, the same object.
"""

import importlib
import sys
import types
import warnings


class _MovedModule(types.ModuleType):
    """A module that forwards every name to the module it was renamed to."""

    def __init__(self, old, new):
        super().__init__(old, f"Renamed: import {new} instead.")
        self._keras_mp_new = new

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        new = object.__getattribute__(self, "_keras_mp_new")
        warnings.warn(
            f"{self.__name__} is now {new}: import {name!r} from there. "
            "The old module path will be removed in the next release.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(new), name)

    def __dir__(self):
        new = object.__getattribute__(self, "_keras_mp_new")
        return dir(importlib.import_module(new))


def alias_modules(package, renamed):
    """Registers `package.<old>` for each `{old: new}` of `renamed` as a
    stand-in forwarding to `package.<new>`.

    Example:

    >>> alias_modules("keras_mp.quantization", {"annotate": "quantize"})
    >>> from keras_mp.quantization.annotate import quantize_model  # warns
    """
    for old, new in renamed.items():
        name = f"{package}.{old}"
        sys.modules.setdefault(name, _MovedModule(name, f"{package}.{new}"))

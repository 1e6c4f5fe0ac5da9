"""`keras_mp`'s public surface (issue #37): `__all__` lists it, every name in
it has a docstring with an example, `dir(keras_mp)` shows no moved name,
and the names that moved (load-only classes to `keras_mp.legacy`, the demo
data to `keras_mp.datasets`) still work for one release with a
DeprecationWarning naming their new home."""

import inspect
import types

import pytest

import keras_mp


def test_all_lists_existing_public_names_once():
    assert len(keras_mp.__all__) == len(set(keras_mp.__all__))
    for name in keras_mp.__all__:
        assert not name.startswith("_")
        assert not isinstance(getattr(keras_mp, name), types.ModuleType)


def test_star_import_gives_the_public_api_only():
    namespace = {}
    exec("from keras_mp import *", namespace)
    names = {n for n in namespace if not n.startswith("__")}
    assert names == set(keras_mp.__all__)


@pytest.mark.parametrize("name", sorted(keras_mp.__all__))
def test_every_public_name_has_a_docstring_with_an_example(name):
    doc = inspect.getdoc(getattr(keras_mp, name)) or ""
    assert doc.strip(), f"keras_mp.{name} has no docstring"
    assert "Example" in doc or ">>>" in doc, f"keras_mp.{name}: no example"


MOVED = {
    "QuantizedModel": "legacy",
    "QuantizeWrapper": "legacy",
    "QuantizeAnnotate": "legacy",
    "SparseModel": "legacy",
    "FixedPointWrapper": "legacy",
    "FixedPointInput": "legacy",
    "PrecisionState": "legacy",
    "load_digits": "datasets",
    "load_fashion_mnist": "datasets",
    "load_images": "datasets",
    "shuffled_batches": "datasets",
}


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_moved_name_still_works_with_a_warning(name):
    home = getattr(keras_mp, MOVED[name])
    with pytest.warns(DeprecationWarning, match=f"keras_mp.{MOVED[name]}"):
        old = getattr(keras_mp, name)
    assert old is getattr(home, name)
    assert name not in dir(keras_mp) and name not in keras_mp.__all__


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        keras_mp.no_such_name  # noqa: B018

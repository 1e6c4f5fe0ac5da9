"""Import-time checks, the TensorFlow-backend check of the entry points,
and lazy imports of optional dependencies."""

import importlib

_EXTRAS = {
    "tf2onnx": "onnx",
    "onnx": "onnx",
    "onnxruntime": "onnx",
    "matplotlib": "plot",
    "sklearn": "data",
}


def check_tensorflow():
    """Fails early, with the install command, when TensorFlow is unusable."""
    try:
        import tensorflow as tf
    except ImportError as e:
        raise ImportError(
            "keras_mp needs TensorFlow >= 2.16: `pip install keras-mp[cpu]` "
            "(tensorflow-cpu) or `pip install keras-mp[gpu]`."
        ) from e
    major, minor = (int(p) for p in tf.__version__.split(".")[:2])
    if (major, minor) < (2, 16):
        raise ImportError(
            f"keras_mp needs TensorFlow >= 2.16 (Keras 3). Found "
            f"{tf.__version__}: `pip install -U keras-mp[cpu]`."
        )
    import keras

    if int(keras.__version__.split(".")[0]) < 3:
        raise ImportError(
            f"keras_mp needs Keras 3. Found keras {keras.__version__}; if "
            "TF_USE_LEGACY_KERAS=1 is set (tfmot sets it), unset it."
        )


def require_tensorflow(what):
    """Refuses, before anything is changed or written, to run `what` on a
    Keras backend other than TensorFlow.

    keras_mp's quantizers, quantized and fixed-point layers, 2:4 callback,
    loss scaling and export (tf2onnx) are TensorFlow code: on JAX they
    fail deep inside `jax.jit`. Importing keras_mp, its reports and its
    backend-neutral helpers work on any backend; each entry point that
    needs TensorFlow calls this first.

    Args:
        what: str. The entry point, as the user called it
            (`"keras_mp.quantize_model"`).

    Raises:
        ValueError: Keras runs on another backend (the message names it
            and says how to switch).
    """
    import keras

    backend = keras.config.backend()
    if backend == "tensorflow":
        return
    raise ValueError(
        f"{what} needs Keras' TensorFlow backend; Keras is running on the "
        f"{backend!r} backend. keras_mp's quantizers, quantized and "
        "fixed-point layers, 2:4 sparsity callback, loss scaling and ONNX "
        "export are written with TensorFlow ops. Switch: set the "
        "environment variable KERAS_BACKEND=tensorflow before keras is "
        'imported (or `"backend": "tensorflow"` in '
        "~/.keras/keras.json); in a running session, call "
        '`keras.config.set_backend("tensorflow")`, then `import keras_mp` '
        "again and rebuild the model. A model trained on "
        f'{backend} moves over as a file: `model.save("model.keras")` '
        'here, then `keras.saving.load_model("model.keras")` in a '
        "TensorFlow-backend process, and quantize or export it there. "
        "Nothing was changed or written."
    )


def optional_import(name):
    """Imports an optional dependency or says which extra installs it."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        extra = _EXTRAS.get(name.split(".")[0], "all")
        raise ImportError(
            f"This feature needs `{name}`: `pip install keras-mp[{extra}]`."
        ) from e

"""The files the subcommands read: a `.keras` model and input arrays."""


def load_keras_model(path):
    """`path` loaded with `safe_mode=True`, or a ValueError that says what
    the file is and why it did not load."""
    import keras

    try:
        return keras.saving.load_model(path, safe_mode=True)
    except Exception as e:  # a damaged file fails anywhere in Keras
        raise ValueError(
            f"Could not load {path} as a Keras model ({type(e).__name__}: {e})"
        ) from e


def load_inputs(path):
    """A `.npy` array, or an `.npz` as a dict of its arrays by name (its one
    array when it holds one, for a one-input model)."""
    import numpy as np

    try:
        data = np.load(path)
        if isinstance(data, np.lib.npyio.NpzFile):
            with data:
                data = {name: data[name] for name in data.files}
    except (OSError, ValueError) as e:
        raise ValueError(
            f"Could not read {path} as a .npy array or .npz of arrays: {e}"
        ) from e
    if isinstance(data, dict) and len(data) == 1:
        return next(iter(data.values()))
    return data

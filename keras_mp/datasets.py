"""Real data loaders: Fashion-MNIST from Debian's IDX files, sklearn digits.

Nothing here downloads anything: Fashion-MNIST comes from the Debian package
`dataset-fashion-mnist` (IDX `.gz` files), and the 8x8 digits set is bundled
inside the scikit-learn wheel.
"""

import gzip
import os
import struct

import numpy as np

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_ENV = "KERAS_MP_FASHION_MNIST"
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
_INSTALL_HINT = (
    "Install it with `apt-get install dataset-fashion-mnist`, or point "
    f"`path=` or the {FASHION_MNIST_ENV} environment variable at a folder "
    "holding the four IDX .gz files."
)
_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4"}


class DatasetError(OSError):
    """A data file is missing or corrupt. The message names the file."""


def read_idx(path):
    """Reads one IDX file (optionally gzip-compressed) into a NumPy array.

    Args:
        path: str. Path to an IDX file, `.gz` or uncompressed.

    Returns:
        A NumPy array with the shape and dtype stored in the file header.

    Raises:
        DatasetError: the file is missing, truncated, or not an IDX file.
    """
    if not os.path.isfile(path):
        raise DatasetError(
            f"Fashion-MNIST file not found: {path}. {_INSTALL_HINT}"
        )
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:
        raise DatasetError(
            f"Could not read {path}: {e}. The file is corrupt; reinstall it "
            f"(`apt-get install --reinstall dataset-fashion-mnist`)."
        ) from e
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise DatasetError(
            f"{path} is not an IDX file (bad magic number). Reinstall it "
            "with `apt-get install --reinstall dataset-fashion-mnist`."
        )
    type_code, ndim = data[2], data[3]
    if type_code not in _IDX_DTYPES:
        raise DatasetError(
            f"{path}: unknown IDX element type 0x{type_code:02x}."
        )
    header = 4 + 4 * ndim
    shape = struct.unpack(f">{ndim}I", data[4:header])
    dtype = np.dtype(_IDX_DTYPES[type_code])
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(data) - header != expected:
        raise DatasetError(
            f"{path} is truncated or corrupt: header says shape {shape} "
            f"({expected} bytes) but the file holds {len(data) - header}. "
            "Reinstall it with `apt-get install --reinstall "
            "dataset-fashion-mnist`."
        )
    return np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)


def fashion_mnist_available(path=None):
    """Returns True when the four Fashion-MNIST IDX files are present."""
    folder = _fashion_mnist_dir(path)
    return all(
        os.path.isfile(os.path.join(folder, name)) for name in _FILES.values()
    )


_FILES = {
    "x_train": "train-images-idx3-ubyte.gz",
    "y_train": "train-labels-idx1-ubyte.gz",
    "x_test": "t10k-images-idx3-ubyte.gz",
    "y_test": "t10k-labels-idx1-ubyte.gz",
}


def _fashion_mnist_dir(path):
    return path or os.environ.get(FASHION_MNIST_ENV) or FASHION_MNIST_DIR


def load_fashion_mnist(path=None, normalize=True):
    """Loads Fashion-MNIST (70,000 real 28x28 grayscale images, 10 classes).

    Args:
        path: str. Folder with the four IDX `.gz` files. Defaults to the
            `KERAS_MP_FASHION_MNIST` environment variable, then
            `/usr/share/datasets/fashion-mnist` (Debian's
            `dataset-fashion-mnist`).
        normalize: bool. If True, images are float32 in [0, 1] with a
            trailing channel axis `(N, 28, 28, 1)`; if False, the raw uint8
            `(N, 28, 28)` arrays. Defaults to True.

    Returns:
        `(x_train, y_train), (x_test, y_test)`: 60,000 training and 10,000
        test images, labels as int64 in [0, 9].

    Raises:
        DatasetError: a file is missing or corrupt; the message names it and
            the install command.

    Example:

    >>> (x, y), (xt, yt) = load_fashion_mnist()  # doctest: +SKIP
    >>> x.shape, xt.shape  # doctest: +SKIP
    ((60000, 28, 28, 1), (10000, 28, 28, 1))
    """
    folder = _fashion_mnist_dir(path)
    arrays = {
        key: read_idx(os.path.join(folder, name))
        for key, name in _FILES.items()
    }
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise DatasetError(
                f"Fashion-MNIST {split} files in {folder} do not match: images "
                f"{x.shape}, labels {y.shape}. {_INSTALL_HINT}"
            )
    out = []
    for split in ("train", "test"):
        x = arrays[f"x_{split}"]
        if normalize:
            x = (x.astype("float32") / 255.0)[..., None]
        out.append((x, arrays[f"y_{split}"].astype("int64")))
    return tuple(out)


def load_digits(normalize=True, test_fraction=0.2, seed=0):
    """Loads scikit-learn's bundled 8x8 digits (1,797 images, 10 classes).

    A small real data set that needs no download: it ships inside the
    scikit-learn wheel (`pip install keras-mp[data]`).

    Args:
        normalize: bool. If True, float32 images in [0, 1] shaped
            `(N, 8, 8, 1)`; if False, the raw 0-16 values `(N, 8, 8)`.
            Defaults to True.
        test_fraction: float. Share of images held out as the test split,
            stratified by class. Defaults to 0.2.
        seed: int. Seed of the split. Defaults to 0.

    Returns:
        `(x_train, y_train), (x_test, y_test)`.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(
            f"`test_fraction` must be in (0, 1). Received: {test_fraction}"
        )
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError as e:
        raise ImportError(
            "load_digits() needs scikit-learn: `pip install keras-mp[data]`."
        ) from e
    bunch = sk_load_digits()
    x = bunch.images.astype("float32")
    if normalize:
        x = (x / 16.0)[..., None]
    y = bunch.target.astype("int64")
    rng = np.random.default_rng(seed)
    test_idx = []
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        rng.shuffle(idx)
        test_idx.extend(idx[: int(round(len(idx) * test_fraction))])
    test_mask = np.zeros(len(y), bool)
    test_mask[test_idx] = True
    return (x[~test_mask], y[~test_mask]), (x[test_mask], y[test_mask])


def load_images(verbose=True):
    """Fashion-MNIST when installed, else scikit-learn's digits, said plainly.

    The default real data of the demo and the examples: the Debian package
    `dataset-fashion-mnist` when present (70,000 28x28 images), otherwise the
    8x8 digits bundled with scikit-learn (1,797 images).

    Args:
        verbose: bool. Print a line when falling back to the digits.
            Defaults to True.

    Returns:
        `name, (x_train, y_train), (x_test, y_test)`, images float32 in
        [0, 1] shaped `(N, H, W, 1)`; `name` says which data set it is.
    """
    if fashion_mnist_available():
        (x, y), (xt, yt) = load_fashion_mnist()
        return "Fashion-MNIST (Debian dataset-fashion-mnist)", (x, y), (xt, yt)
    if verbose:
        print(
            "Fashion-MNIST is not installed (`apt-get install "
            "dataset-fashion-mnist`); using scikit-learn's 8x8 digits."
        )
    (x, y), (xt, yt) = load_digits()
    return "scikit-learn digits (Fashion-MNIST not installed)", (x, y), (xt, yt)


def shuffled_batches(x, y, batch_size=128, seed=0):
    """A `tf.data.Dataset` of shuffled `(x, y)` batches, ragged last batch
    dropped.

    Every batch has one shape, so `fit` traces and compiles its train step
    once (a smaller last batch would compile it a second time); each epoch
    reshuffles and so drops a different remainder.

    Args:
        x: array of inputs.
        y: array of labels, as many as `x`.
        batch_size: int. At most this many examples per batch (all of them
            when there are fewer). Defaults to 128.
        seed: int. Shuffle seed. Defaults to 0.

    Returns:
        A `tf.data.Dataset`.
    """
    import tensorflow as tf

    if len(x) != len(y) or len(x) == 0:
        raise ValueError(
            f"x and y need the same, nonzero number of examples. Received: "
            f"len(x)={len(x)}, len(y)={len(y)}"
        )
    return (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(len(x), seed=seed, reshuffle_each_iteration=True)
        .batch(min(batch_size, len(x)), drop_remainder=True)
        .prefetch(2)
    )

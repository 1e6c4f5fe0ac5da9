import gzip
import os
import shutil

import numpy as np
import pytest

from keras_mp import datasets


def test_fashion_mnist_is_real_and_shaped(fashion_mnist):
    (x, y), (xt, yt) = fashion_mnist
    assert x.shape == (60000, 28, 28, 1) and xt.shape == (10000, 28, 28, 1)
    assert x.dtype == np.float32 and 0.0 <= x.min() and x.max() <= 1.0
    assert set(np.unique(y)) == set(range(10))
    assert np.bincount(yt).tolist() == [1000] * 10  # the published split


def test_raw_uint8_mode():
    (x, _), _ = datasets.load_fashion_mnist(normalize=False)
    assert x.dtype == np.uint8 and x.shape == (60000, 28, 28)


def _copy_dataset(tmp_path):
    for name in datasets._FILES.values():
        shutil.copy(os.path.join(datasets.FASHION_MNIST_DIR, name), tmp_path)
    return tmp_path


def test_env_var_overrides_default(tmp_path, monkeypatch):
    folder = _copy_dataset(tmp_path)
    monkeypatch.setenv(datasets.FASHION_MNIST_ENV, str(folder))
    os.remove(folder / "t10k-labels-idx1-ubyte.gz")
    with pytest.raises(datasets.DatasetError, match="t10k-labels"):
        datasets.load_fashion_mnist()


def test_missing_file_names_file_and_install_command(tmp_path):
    with pytest.raises(datasets.DatasetError) as info:
        datasets.load_fashion_mnist(path=str(tmp_path))
    message = str(info.value)
    assert "train-images-idx3-ubyte.gz" in message
    assert "apt-get install dataset-fashion-mnist" in message


def test_truncated_file_is_reported(tmp_path):
    folder = _copy_dataset(tmp_path)
    target = folder / "t10k-images-idx3-ubyte.gz"
    raw = gzip.decompress(target.read_bytes())
    target.write_bytes(gzip.compress(raw[:-100]))
    with pytest.raises(datasets.DatasetError, match="truncated or corrupt"):
        datasets.load_fashion_mnist(path=str(folder))


def test_not_gzip_is_reported(tmp_path):
    folder = _copy_dataset(tmp_path)
    (folder / "t10k-images-idx3-ubyte.gz").write_bytes(b"not a gzip file")
    with pytest.raises(datasets.DatasetError, match="t10k-images"):
        datasets.load_fashion_mnist(path=str(folder))


def test_digits_split_is_stratified_and_disjoint(digits):
    (x, y), (xt, yt) = digits
    assert x.shape[1:] == (8, 8, 1) and len(x) + len(xt) == 1797
    assert 0.0 <= x.min() and x.max() <= 1.0
    assert set(np.unique(yt)) == set(range(10))
    with pytest.raises(ValueError, match="test_fraction"):
        datasets.load_digits(test_fraction=1.5)


def test_load_images_falls_back_to_digits_and_says_so(
    tmp_path, monkeypatch, capsys
):
    name, (x, _), _ = datasets.load_images()
    assert name.startswith("Fashion-MNIST") and x.shape[1:] == (28, 28, 1)
    monkeypatch.setenv(datasets.FASHION_MNIST_ENV, str(tmp_path / "none"))
    name, (x, y), (xt, _) = datasets.load_images()
    assert name.startswith("scikit-learn digits") and x.shape[1:] == (8, 8, 1)
    assert len(x) + len(xt) == 1797 and set(np.unique(y)) == set(range(10))
    assert "apt-get install dataset-fashion-mnist" in capsys.readouterr().out


def test_shuffled_batches_have_one_shape_and_reject_bad_input():
    x = np.arange(300, dtype="float32").reshape(300, 1)
    y = np.arange(300)
    shapes = {tuple(b[0].shape) for b in datasets.shuffled_batches(x, y, 128)}
    assert shapes == {(128, 1)}  # 2 full batches, the 44 left over dropped
    small = list(datasets.shuffled_batches(x[:5], y[:5], 128))
    assert len(small) == 1 and small[0][0].shape[0] == 5
    with pytest.raises(ValueError, match="same, nonzero number"):
        datasets.shuffled_batches(x, y[:10])

import gzip
import os
import shutil
import struct

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
    with pytest.raises(
        ValueError, match=r"`test_fraction` must be in \(0, 1\). Received: 1.5"
    ):
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


def _write_idx(path, array):
    header = bytes([0, 0, 0x08, array.ndim])
    header += struct.pack(f">{array.ndim}I", *array.shape)
    with open(path, "wb") as f:
        f.write(gzip.compress(header + array.tobytes()))


def test_mismatched_image_and_label_files_are_reported(tmp_path):
    files = datasets._FILES
    _write_idx(tmp_path / files["x_train"], np.zeros((3, 28, 28), np.uint8))
    _write_idx(tmp_path / files["y_train"], np.zeros((2,), np.uint8))
    _write_idx(tmp_path / files["x_test"], np.zeros((2, 28, 28), np.uint8))
    _write_idx(tmp_path / files["y_test"], np.zeros((2,), np.uint8))
    with pytest.raises(
        datasets.DatasetError,
        match=r"train files .* do not match: images \(3, 28, 28\), "
        r"labels \(2,\)",
    ):
        datasets.load_fashion_mnist(path=str(tmp_path))


@pytest.mark.parametrize(
    "name, data, match",
    [
        ("magic.idx", b"\x01\x02\x08\x01" + b"\0" * 8, "bad magic number"),
        (
            "type.idx",
            b"\0\0\x42\x01\0\0\0\x01x",
            "unknown IDX element type 0x42",
        ),
        (
            "short.idx",
            b"\0\0\x08\x01\0\0\0\x09abc",
            r"truncated or corrupt: header says shape \(9,\) \(9 bytes\)",
        ),
        (
            "broken.idx.gz",
            gzip.compress(b"\0" * 64, mtime=0)[:20],
            "broken.idx.gz.*corrupt; reinstall",
        ),
    ],
    ids=["magic", "type", "short", "gzip"],
)
def test_corrupt_idx_file_is_reported(tmp_path, name, data, match):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(datasets.DatasetError, match=match):
        datasets.read_idx(str(tmp_path / name))

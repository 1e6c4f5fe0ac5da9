"""Peer benchmark, step 1 (main venv): the float32 model every peer starts from.

Trains `reference_cnn` in float32 once and writes, into the work folder:

- `data.npz`: the split every peer uses (raw uint8 images, normalized the
  same way by each helper as `x / 255`): training part, validation slice
  (the last `--val-images` of the 60,000 training images, never trained
  on), the 10,000 test images, the calibration images (the first
  `--calib-images` of the training part) and one fixed fine-tune
  permutation of the training part (shared by every QAT run and control).
- `float.keras`: the trained model.
- `float_weights.npz`: its weights layer by layer (`<layer>/<i>`), for the
  tf_keras twin.
- `float.onnx`: `keras_mp.export_onnx` of the float model (ONNX Runtime
  parity checked on validation images).
- `float.json`: Keras test/validation top-1 and timings.

    python benchmarks/peers/train_float.py --workdir DIR [--quick]
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_mp  # noqa: E402
from keras_mp.reference import compile_classifier, reference_cnn  # noqa: E402

BATCH = 128


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workdir", required=True)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--train-images", type=int, default=55000)
    p.add_argument("--val-images", type=int, default=5000)
    p.add_argument("--calib-images", type=int, default=2048)
    p.add_argument("--finetune-epochs", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    os.makedirs(a.workdir, exist_ok=True)

    (x_raw, y), (xt_raw, yt) = keras_mp.datasets.load_fashion_mnist(
        normalize=False
    )
    if a.train_images + a.val_images > len(x_raw):
        raise SystemExit("train + validation images exceed the 60,000")
    val = slice(len(x_raw) - a.val_images, len(x_raw))
    x_tr, y_tr = x_raw[: a.train_images], y[: a.train_images]
    x_val, y_val = x_raw[val], y[val]
    rng = np.random.default_rng(a.seed + 1)
    order = np.concatenate(
        [rng.permutation(len(x_tr)) for _ in range(a.finetune_epochs)]
    )
    np.savez(
        os.path.join(a.workdir, "data.npz"),
        x_train=x_tr,
        y_train=y_tr.astype(np.int64),
        x_val=x_val,
        y_val=y_val.astype(np.int64),
        x_test=xt_raw,
        y_test=yt.astype(np.int64),
        x_calib=x_tr[: a.calib_images],
        finetune_order=order,
    )

    def norm(v):  # exactly keras_mp.load_fashion_mnist's normalization
        return (v.astype("float32") / 255.0)[..., None]

    x, xv, xt = norm(x_tr), norm(x_val), norm(xt_raw)
    keras.utils.set_random_seed(a.seed)
    model = compile_classifier(reference_cnn(width=a.width), learning_rate=1e-3)
    start = time.perf_counter()
    model.fit(
        x, y_tr, batch_size=BATCH, epochs=a.epochs, shuffle=True, verbose=2
    )
    train_s = time.perf_counter() - start
    _, test_acc = model.evaluate(xt, yt, batch_size=1000, verbose=0)
    _, val_acc = model.evaluate(xv, y_val, batch_size=1000, verbose=0)

    model.save(os.path.join(a.workdir, "float.keras"))
    weights = {
        f"{layer.name}/{i}": w
        for layer in model.layers
        for i, w in enumerate(layer.get_weights())
    }
    np.savez(os.path.join(a.workdir, "float_weights.npz"), **weights)
    parity = keras_mp.export_onnx(
        model,
        os.path.join(a.workdir, "float.onnx"),
        verify_data=xv[:1000],
        overwrite=True,
    )
    print(parity)
    out = {
        "keras_test_top1": round(100 * float(test_acc), 2),
        "keras_val_top1": round(100 * float(val_acc), 2),
        "train_seconds": round(train_s, 1),
        "train_images": len(x),
        "val_images": len(xv),
        "calib_images": a.calib_images,
        "epochs": a.epochs,
        "width": a.width,
        "parameters": int(model.count_params()),
        "onnx_parity": str(parity),
    }
    with open(os.path.join(a.workdir, "float.json"), "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

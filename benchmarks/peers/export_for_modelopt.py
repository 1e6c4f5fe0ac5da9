"""Float ONNX models and data for ModelOpt AutoQuantize (main venv).

Trains three float32 classifiers briefly on Fashion-MNIST (Debian's
`dataset-fashion-mnist`) and exports each with `keras_mp.export_onnx`
(float: no Q/DQ; ONNX Runtime parity checked on calibration images), for
`modelopt_autoquant.py`, which runs in the ModelOpt venv:

- `reference_cnn`: `keras_mp.reference.reference_cnn(width=16)`, 28x28x1;
- `mobilenetv2`: `keras.applications.MobileNetV2(alpha=0.35)`,
  `weights=None`, behind a `ZeroPadding2D(2)` so it takes the same 28x28x1
  images (32x32 inside, the smallest size the application accepts),
  BatchNormalization momentum 0.9 as in `bench_trained_parity.py`;
- `vit`: `keras_mp.cli.demo_vit.vit_classifier` (keras-hub `ViTBackbone`,
  2 layers, hidden 64); left out, with the reason, without keras-hub.

Each is trained `--steps` steps of batch 128 (Adam, learning rate cosine-
decayed from `--learning-rate`), float32, logits out. Writes into the
output folder:

- `<name>.onnx`: the float model (NHWC input, as the Keras model);
- `data.npz`: `x_calib`, `y_calib` (the first `--calib-images` training
  images, never the evaluation ones), `x_eval`, `y_eval` (the first
  `--eval-images` test images); float32 in [0, 1], shape (N, 28, 28, 1),
  labels int64;
- `manifest.json`: per model its ONNX file, input name, parameters, Keras
  top-1 on the evaluation images, training seconds, or its error.

    python benchmarks/peers/export_for_modelopt.py OUTDIR [--steps 400]
        [--only reference_cnn mobilenetv2 vit]
"""

import argparse
import json
import os
import sys
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_mp  # noqa: E402
from keras_mp.datasets import shuffled_batches  # noqa: E402
from keras_mp.reference import (  # noqa: E402
    compile_classifier,
    cosine_adam,
    reference_cnn,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _peer_common import write_json  # noqa: E402

BATCH = 128
BN_MOMENTUM = 0.9
SHAPE = (28, 28, 1)
MODELS = ("reference_cnn", "mobilenetv2", "vit")


def build_reference_cnn():
    return reference_cnn(SHAPE, width=16)


def build_mobilenetv2():
    """MobileNetV2 (alpha 0.35) at 32x32, fed 28x28 images padded by 2."""
    core = keras.applications.MobileNetV2(
        weights=None,
        input_shape=(32, 32, 1),
        alpha=0.35,
        classes=10,
        classifier_activation=None,
    )
    for layer in core.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.momentum = BN_MOMENTUM
    inputs = keras.Input(SHAPE, name="image")
    x = keras.layers.ZeroPadding2D(2, name="pad")(inputs)
    return keras.Model(inputs, core(x), name="mobilenetv2")


def build_vit():
    from keras_mp.cli import demo_vit

    return demo_vit.vit_classifier(SHAPE)


BUILDERS = {
    "reference_cnn": (build_reference_cnn, 2e-3),
    "mobilenetv2": (build_mobilenetv2, 2e-3),
    "vit": (build_vit, 1e-3),
}


def top1(model, x, y):
    logits = model.predict(x, batch_size=500, verbose=0)
    return round(100.0 * float(np.mean(np.argmax(logits, -1) == y)), 2)


def onnx_input_name(path):
    import onnx

    graph = onnx.load(path, load_external_data=False).graph
    inits = {i.name for i in graph.initializer}
    return [i.name for i in graph.input if i.name not in inits][0]


def export_one(name, data, out, steps, learning_rate, seed):
    """Trains and exports one model; returns its manifest entry."""
    build, default_lr = BUILDERS[name]
    keras.utils.set_random_seed(seed)
    model = build()
    lr = learning_rate or default_lr
    compile_classifier(model, optimizer=cosine_adam(steps, lr))
    x, y = data["x_train"][: steps * BATCH], data["y_train"][: steps * BATCH]
    start = time.perf_counter()
    model.fit(shuffled_batches(x, y, BATCH, seed=seed), epochs=1, verbose=2)
    train_seconds = round(time.perf_counter() - start, 1)
    path = os.path.join(out, f"{name}.onnx")
    start = time.perf_counter()
    keras_mp.export_onnx(
        model, path, verify_data=data["x_calib"][:64], overwrite=True
    )
    return {
        "onnx": os.path.basename(path),
        "input_name": onnx_input_name(path),
        "params": int(model.count_params()),
        "train_steps": steps,
        "train_images": int(len(x)),
        "learning_rate": lr,
        "train_seconds": train_seconds,
        "export_seconds": round(time.perf_counter() - start, 1),
        "keras_eval_top1": top1(model, data["x_eval"], data["y_eval"]),
    }


def main():
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("outdir")
    p.add_argument("--only", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--steps", type=int, default=400)
    p.add_argument(
        "--learning-rate",
        type=float,
        default=None,
        help="initial rate (default 2e-3 for the CNNs, 1e-3 for the ViT)",
    )
    p.add_argument("--calib-images", type=int, default=1024)
    p.add_argument("--eval-images", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    os.makedirs(a.outdir, exist_ok=True)

    (x, y), (xt, yt) = keras_mp.datasets.load_fashion_mnist()
    # Calibration images come from the end of the training set, training
    # batches from its start: disjoint for any --steps below 60000/128 - 8.
    data = {
        "x_train": x,
        "y_train": y,
        "x_calib": x[-a.calib_images :],
        "y_calib": y[-a.calib_images :],
        "x_eval": xt[: a.eval_images],
        "y_eval": yt[: a.eval_images],
    }
    np.savez(
        os.path.join(a.outdir, "data.npz"),
        **{k: v for k, v in data.items() if not k.endswith("_train")},
    )
    manifest_path = os.path.join(a.outdir, "manifest.json")
    manifest = {"models": {}}
    if os.path.exists(manifest_path):
        with open(manifest_path) as f:
            manifest = json.load(f)
    manifest.update(
        data="data.npz",
        calib_images=a.calib_images,
        eval_images=a.eval_images,
        batch=BATCH,
        seed=a.seed,
        keras=keras.__version__,
    )
    for name in a.only:
        print(f"== {name}: {a.steps} steps, then export", flush=True)
        try:
            entry = export_one(
                name, data, a.outdir, a.steps, a.learning_rate, a.seed
            )
        except Exception as e:  # a model that fails is a result
            traceback.print_exc()
            entry = {"error": f"{type(e).__name__}: {e}"}
        manifest["models"][name] = entry
        print(name, entry, flush=True)
        write_json(a.outdir, "manifest", manifest)


if __name__ == "__main__":
    main()

"""Peer benchmark (tfmot venv, its own process): tfmot QAT on a tf_keras twin.

tfmot 0.8.1 accepts only tf_keras (Keras 2) models, and importing it
switches the process to legacy Keras, so this runs in
`benchmarks/.venv-tfmot` (tensorflow-cpu, tf-keras, tensorflow-model-
optimization, tf2onnx, onnx), never in the main venv.

- Builds a tf_keras twin of `keras_mp.reference.reference_cnn` (same
  layers, names, shapes) and copies the shared float weights into it layer
  by layer from `float_weights.npz`; checks its test top-1 against the
  Keras 3 model's.
- `tfmot.quantization.keras.quantize_model`, then fine-tunes 1 epoch
  with Adam and cosine decay from `--lr`; the control is the float twin
  fine-tuned identically. Both are fine-tuned afresh on each of
  `--qat-seeds` fine-tune orders (`_peer_common.finetune_arrays`, the same
  batches as keras_mp's) with the tf_keras seed `--seed` + 1 + k, and their
  tf_keras test top-1 is recorded per order (`runs`) with its mean and sd.
- The order-0 models are the ones timed and exported: step time is QAT
  `train_on_batch` / float twin `train_on_batch`, interleaved rounds;
  `tfmot_qat.onnx` is written with tf2onnx (`from_keras`, falling back to
  `from_function` on a traced `tf.function`).

Writes `tfmot.json` in the work folder.
"""

import argparse
import json
import os
import sys
import traceback

os.environ["TF_USE_LEGACY_KERAS"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tensorflow_model_optimization as tfmot  # noqa: E402
import tf_keras  # noqa: E402
from _peer_common import (  # noqa: E402
    BATCH,
    cosine_lr_note,
    finetune_orders,
    load_data,
    order_summary,
    positive_int,
    step_time_report,
    write_json,
)


def twin_cnn(width, input_shape=(28, 28, 1), num_classes=10):
    """tf_keras copy of keras_mp.reference.reference_cnn (same names)."""
    L = tf_keras.layers
    inputs = tf_keras.Input(input_shape, name="image")
    x = L.Conv2D(width, 3, padding="same", use_bias=False, name="stem")(inputs)
    x = L.BatchNormalization(momentum=0.9, name="stem_bn")(x)
    x = L.ReLU(name="stem_relu")(x)
    y = L.Conv2D(width, 3, padding="same", use_bias=False, name="res_a")(x)
    y = L.BatchNormalization(momentum=0.9, name="res_a_bn")(y)
    y = L.ReLU(name="res_a_relu")(y)
    y = L.Conv2D(width, 3, padding="same", use_bias=False, name="res_b")(y)
    y = L.BatchNormalization(momentum=0.9, name="res_b_bn")(y)
    x = L.Add(name="res_add")([x, y])
    x = L.ReLU(name="res_relu")(x)
    x = L.MaxPooling2D(name="pool1")(x)
    x = L.DepthwiseConv2D(3, padding="same", use_bias=False, name="dw")(x)
    x = L.BatchNormalization(momentum=0.9, name="dw_bn")(x)
    x = L.ReLU(name="dw_relu")(x)
    x = L.Conv2D(2 * width, 1, use_bias=False, name="pw")(x)
    x = L.BatchNormalization(momentum=0.9, name="pw_bn")(x)
    x = L.ReLU(name="pw_relu")(x)
    x = L.MaxPooling2D(name="pool2")(x)
    x = L.Conv2D(2 * width, 3, padding="same", name="conv3")(x)
    x = L.ReLU(name="conv3_relu")(x)
    x = L.GlobalAveragePooling2D(name="gap")(x)
    x = L.Dense(2 * width, activation="relu", name="fc")(x)
    outputs = L.Dense(num_classes, name="logits")(x)
    return tf_keras.Model(inputs, outputs, name="reference_cnn_tf_keras")


def load_weights(model, path):
    weights = np.load(path)
    copied = 0
    for layer in model.layers:
        n = len(layer.get_weights())
        if not n:
            continue
        layer.set_weights([weights[f"{layer.name}/{i}"] for i in range(n)])
        copied += 1
    return copied


def compile_model(model, optimizer=None):
    model.compile(
        optimizer=optimizer or tf_keras.optimizers.Adam(1e-3),
        loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def top1(model, x, y):
    _, acc = model.evaluate(x, y, batch_size=1000, verbose=0)
    return round(100 * float(acc), 2)


def fresh_control(fmodel, optimizer):
    """The float32 control: a copy of the float twin, compiled to fine-tune."""
    control = tf_keras.models.clone_model(fmodel)
    control.set_weights(fmodel.get_weights())
    return compile_model(control, optimizer)


def fresh_qat(fmodel, optimizer):
    """tfmot's QAT model of the float twin, compiled to fine-tune."""
    return compile_model(
        tfmot.quantization.keras.quantize_model(fmodel), optimizer
    )


def export(model, path):
    import tf2onnx

    spec = [tf.TensorSpec((None, 28, 28, 1), tf.float32, name="input_0")]
    try:
        tf2onnx.convert.from_keras(
            model, input_signature=spec, opset=17, output_path=path
        )
        return "tf2onnx.convert.from_keras", None
    except Exception as e:  # tf2onnx raises bare exceptions
        first = f"from_keras: {type(e).__name__}: {e}"
    try:

        @tf.function(input_signature=spec)
        def serve(x):
            return model(x, training=False)

        tf2onnx.convert.from_function(
            serve, input_signature=spec, opset=17, output_path=path
        )
        return "tf2onnx.convert.from_function", first
    except Exception as e:
        raise RuntimeError(
            f"{first}; from_function: {type(e).__name__}: {e}"
        ) from e


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workdir", required=True)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--qat-seeds",
        type=positive_int,
        default=3,
        help="fine-tune orders (and seeds) for the QAT model and its control",
    )
    p.add_argument("--timing-rounds", type=int, default=30)
    p.add_argument("--timing-repeats", type=int, default=3)
    a = p.parse_args()
    w = a.workdir
    d = load_data(w)
    with open(os.path.join(w, "float.json")) as f:
        width = json.load(f)["width"]
    out = {"keras_backend": tf_keras.__name__ + " " + tf_keras.__version__}

    tf_keras.utils.set_random_seed(a.seed)
    fmodel = compile_model(twin_cnn(width))
    out["layers_copied"] = load_weights(
        fmodel, os.path.join(w, "float_weights.npz")
    )
    out["float_twin_test_top1"] = top1(fmodel, d["x_test"], d["y_test"])
    print(f"tf_keras float twin test top-1: {out['float_twin_test_top1']}")

    # Before any fine-tune: tfmot's ranges start uncalibrated.
    out["qat_before_finetune_test_top1"] = top1(
        fresh_qat(fmodel, None), d["x_test"], d["y_test"]
    )
    steps = -(-len(d["finetune_order"]) // BATCH)

    def optimizer():
        return tf_keras.optimizers.Adam(
            tf_keras.optimizers.schedules.CosineDecay(a.lr, decay_steps=steps)
        )

    runs, first = finetune_orders(
        d,
        a.qat_seeds,
        a.seed,
        tf_keras.utils.set_random_seed,
        {
            "control": lambda: fresh_control(fmodel, optimizer()),
            "qat": lambda: fresh_qat(fmodel, optimizer()),
        },
        top1,
    )
    (control, control_s), (qat, qat_s) = first["control"], first["qat"]
    out["runs"] = runs
    out["control"] = {
        **order_summary(runs, "control"),
        "finetune_seconds": control_s,
    }
    out["qat"] = {
        **order_summary(runs, "qat"),
        "finetune_seconds": qat_s,
        "optimizer": cosine_lr_note(a.lr, steps),
    }

    xb, yb = d["x_train"][:BATCH], d["y_train"][:BATCH]
    out["step_time"] = step_time_report(
        lambda: control.train_on_batch(xb, yb),
        lambda: qat.train_on_batch(xb, yb),
        a.timing_rounds,
        a.timing_repeats,
    )
    try:
        how, note = export(qat, os.path.join(w, "tfmot_qat.onnx"))
        out["export"] = {"ok": True, "how": how, "note": note}
    except Exception as e:
        out["export"] = {
            "ok": False,
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc()[-2000:],
        }
    write_json(w, "tfmot", out)


if __name__ == "__main__":
    main()

"""Wide & Deep and a DLRM-style model under mixed precision, to ONNX.

THE CLICK DATA IN THIS EXAMPLE IS SYNTHETIC. No real click log (Criteo,
Avazu, MovieLens) can be downloaded here, so `synthetic_clicks` draws one
from a known generator: 13 dense features and 8 categorical fields (like
Criteo's layout), and a click probability built from a linear term in the
dense features, per-category biases, and dot products between hidden
embeddings of some field pairs (the interactions a DLRM is built to
learn). Accuracy figures on it say that the models learn, and nothing about
any real recommender. The generator's own AUC is printed as the ceiling.

Two models, each one input vector `[13 dense | 8 category ids]` (ids as
float32, exact below 2**24) so that the ONNX file has a single input:

- Wide & Deep (Cheng et al., 2016): a wide linear part over the dense
  features, one weight per category and a hashed cross of two fields,
  plus a deep MLP over the dense features and 16-d embeddings.
- DLRM-style (Naumov et al., 2019): a bottom MLP maps the dense features to
  a 16-d vector, the pairwise dot products of it and the 8 embeddings go
  with it into a top MLP.

Both train under `keras_mp.enable_mixed_precision("mixed_float16")` with
`keras_mp.LossScaleOptimizer` and `keras_mp.LossScaleMonitor` (output
logits in float32), get a `keras_mp.mixed_precision_audit`, and are
exported with `keras_mp.export_onnx(..., verify_data=...)`, which checks
ONNX Runtime against Keras before the file lands.

Run:

    python examples/recommender.py          # ~2 min on 2 cores
    python examples/recommender.py --quick  # smoke run
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import layers, ops  # noqa: E402

import keras_mp  # noqa: E402

NUM_DENSE = 13
VOCAB_SIZES = (1000, 500, 200, 100, 50, 24, 12, 1000)
EMBEDDING_DIM = 16  # a multiple of 8: Tensor Core aligned
CROSS_BUCKETS = 4096


def synthetic_clicks(num_samples, seed=0, generator_seed=1234):
    """SYNTHETIC click data: features, labels and the true click probability.

    Every call with the same `generator_seed` shares one generator (the
    hidden weights); `seed` draws the samples, so train and test come from
    the same distribution.

    Returns:
        `(features, labels, probability)`: float32 `(N, 21)` features
        (13 dense, then 8 category ids), int labels, the generator's click
        probability of each sample.
    """
    hidden = np.random.default_rng(generator_seed)
    dense_weights = hidden.normal(0, 0.4, NUM_DENSE)
    biases = [hidden.normal(0, 0.6, v) for v in VOCAB_SIZES]
    factors = [hidden.normal(0, 0.5, (v, 4)) for v in VOCAB_SIZES]
    pairs = ((0, 1), (0, 7), (2, 3), (4, 5), (1, 6))

    rng = np.random.default_rng(seed)
    dense = rng.lognormal(0.0, 1.0, (num_samples, NUM_DENSE))
    dense = np.log1p(dense).astype("float32")  # Criteo-style log transform
    # Zipf-like category frequencies: a few popular ids, a long tail.
    ids = np.stack(
        [
            np.minimum(rng.zipf(1.3, num_samples) - 1, v - 1)
            for v in VOCAB_SIZES
        ],
        axis=1,
    )
    logit = (dense - dense.mean(0)) @ dense_weights - 1.2
    for field in range(len(VOCAB_SIZES)):
        logit += biases[field][ids[:, field]]
    for a, b in pairs:
        logit += np.sum(factors[a][ids[:, a]] * factors[b][ids[:, b]], axis=1)
    probability = 1.0 / (1.0 + np.exp(-logit))
    labels = (rng.random(num_samples) < probability).astype("int64")
    features = np.concatenate([dense, ids.astype("float32")], axis=1)
    return features, labels, probability


def split_features(inputs):
    """`[dense | ids]` -> dense float features and one int id per field."""
    dense = inputs[:, :NUM_DENSE]
    ids = ops.cast(inputs[:, NUM_DENSE:], "int32")
    return dense, [ids[:, i] for i in range(len(VOCAB_SIZES))]


def wide_and_deep():
    inputs = keras.Input((NUM_DENSE + len(VOCAB_SIZES),), name="features")
    dense, ids = split_features(inputs)
    # Wide: linear in the dense features, a weight per category, and a
    # hashed cross of the first two fields.
    cross = (ids[0] * VOCAB_SIZES[1] + ids[1]) % CROSS_BUCKETS
    wide = [layers.Dense(1, name="wide_dense")(dense)]
    for i, (field, vocab) in enumerate(zip(ids, VOCAB_SIZES)):
        wide.append(layers.Embedding(vocab, 1, name=f"wide_{i}")(field))
    wide.append(layers.Embedding(CROSS_BUCKETS, 1, name="wide_cross")(cross))
    wide = layers.Add(name="wide_sum")(wide)
    # Deep: embeddings and dense features through an MLP.
    embedded = [
        layers.Embedding(vocab, EMBEDDING_DIM, name=f"deep_embedding_{i}")(f)
        for i, (f, vocab) in enumerate(zip(ids, VOCAB_SIZES))
    ]
    x = layers.Concatenate(name="deep_concat")([dense, *embedded])
    for units in (256, 128, 64):
        x = layers.Dense(units, activation="relu", name=f"deep_{units}")(x)
    deep = layers.Dense(1, name="deep_out")(x)
    logit = layers.Add(name="wide_plus_deep")([wide, deep])
    # The output in float32: the loss and the exported logits need it.
    logit = layers.Activation("linear", dtype="float32", name="logit")(logit)
    return keras.Model(inputs, logit, name="wide_and_deep")


@keras.saving.register_keras_serializable(package="examples")
class DotInteraction(layers.Layer):
    """DLRM's interaction: dot products of every pair of feature vectors.

    Input `(batch, features, dim)`; output `(batch, features * (features -
    1) / 2)`, the strictly upper triangle of `x @ x^T`.
    """

    def call(self, inputs):
        count = inputs.shape[1]
        gram = ops.matmul(inputs, ops.transpose(inputs, (0, 2, 1)))
        upper = [
            i * count + j for i in range(count) for j in range(i + 1, count)
        ]
        flat = ops.reshape(gram, (-1, count * count))
        return ops.take(flat, np.array(upper, "int32"), axis=1)

    def compute_output_shape(self, input_shape):
        count = input_shape[1]
        return (input_shape[0], count * (count - 1) // 2)


def dlrm():
    inputs = keras.Input((NUM_DENSE + len(VOCAB_SIZES),), name="features")
    dense, ids = split_features(inputs)
    x = dense
    for units in (64, 32):
        x = layers.Dense(units, activation="relu", name=f"bottom_{units}")(x)
    bottom = layers.Dense(EMBEDDING_DIM, activation="relu", name="bottom_out")(
        x
    )
    embedded = [
        layers.Embedding(vocab, EMBEDDING_DIM, name=f"embedding_{i}")(f)
        for i, (f, vocab) in enumerate(zip(ids, VOCAB_SIZES))
    ]
    stacked = ops.stack([bottom, *embedded], axis=1)
    pairs = DotInteraction(name="dot_interaction")(stacked)
    x = layers.Concatenate(name="top_concat")([bottom, pairs])
    for units in (128, 64):
        x = layers.Dense(units, activation="relu", name=f"top_{units}")(x)
    logit = layers.Dense(1, dtype="float32", name="logit")(x)
    return keras.Model(inputs, logit, name="dlrm")


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny smoke run (seconds)"
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-samples", type=int, default=200_000)
    parser.add_argument(
        "--policy",
        default="mixed_float16",
        choices=("mixed_float16", "mixed_bfloat16", "auto"),
    )
    parser.add_argument(
        "--output",
        default=os.path.join("example-output", "recommender"),
        help="folder for the ONNX files",
    )
    args = parser.parse_args(argv)
    epochs = 1 if args.quick else args.epochs
    train_samples = 4096 if args.quick else args.train_samples
    test_samples = 2048 if args.quick else 50_000
    keras.utils.set_random_seed(0)
    os.makedirs(args.output, exist_ok=True)

    x, y, _ = synthetic_clicks(train_samples, seed=0)
    xt, yt, pt = synthetic_clicks(test_samples, seed=1)
    oracle = keras.metrics.AUC()
    oracle.update_state(yt, pt)
    print(
        f"SYNTHETIC click data (no real click log is available offline): "
        f"{len(x):,} training and {len(xt):,} test samples, "
        f"{NUM_DENSE} dense features, {len(VOCAB_SIZES)} categorical fields, "
        f"click rate {y.mean():.1%}. The generator's own test AUC (the "
        f"ceiling): {float(oracle.result()):.4f}."
    )
    if args.quick:
        print("--quick: a smoke run on a slice; accuracy means nothing here.")

    results = {}
    with keras_mp.enable_mixed_precision(args.policy) as previous:
        policy = keras.mixed_precision.global_policy().name
        print(f"Policy: {policy} (restored to {previous} afterwards).")
        for build in (wide_and_deep, dlrm):
            keras.utils.set_random_seed(0)
            model = build()
            print(f"\n{model.name}: {model.count_params():,} parameters")
            audit = keras_mp.mixed_precision_audit(
                model, batch_size=512, verbose=False
            )
            print(f"  audit: {audit.summary}")
            optimizer = keras.optimizers.Adam(1e-3)
            if policy == "mixed_float16":
                optimizer = keras_mp.LossScaleOptimizer(optimizer)
            model.compile(
                optimizer,
                keras.losses.BinaryCrossentropy(from_logits=True),
                metrics=[keras.metrics.AUC(from_logits=True, name="auc")],
            )
            model.fit(
                x,
                y,
                batch_size=512,
                epochs=epochs,
                callbacks=[keras_mp.LossScaleMonitor()],
                verbose=2,
            )
            _, auc = model.evaluate(xt, yt, batch_size=4096, verbose=0)
            path = os.path.join(args.output, f"{model.name}.onnx")
            parity = keras_mp.export_onnx(
                model, path, verify_data=xt[:2000], overwrite=True
            )
            size = os.path.getsize(path) / 1e6
            print(f"  test AUC on synthetic clicks: {auc:.4f}")
            print(f"  wrote {path} ({size:.1f} MB). {parity}")
            results[model.name] = {
                "test_auc": float(auc),
                "onnx": path,
                "parity_rel_l2": parity.rel_l2,
            }
    print(
        "\nSYNTHETIC data. Test AUC: "
        + ", ".join(f"{n} {r['test_auc']:.4f}" for n, r in results.items())
        + f"; generator ceiling {float(oracle.result()):.4f}."
    )
    return results


if __name__ == "__main__":
    main()

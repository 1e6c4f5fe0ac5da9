"""Wide & Deep, a DLRM-style model and a GRU session model, to ONNX.

THE CLICK DATA IN THIS EXAMPLE IS SYNTHETIC. No real click log (Criteo,
Avazu, MovieLens) can be downloaded here, so `synthetic_clicks` draws one
from a known generator: 13 dense features and 8 categorical fields (like
Criteo's layout), and a click probability built from a linear term in the
dense features, per-category biases, and dot products between hidden
embeddings of some field pairs (the interactions a DLRM is built to
learn). Accuracy figures on it say that the models learn, and nothing about
any real recommender. The generator's own AUC is printed as the ceiling.

The sessions are synthetic too, drawn from the same generator:
`synthetic_sessions` reads the first categorical field as an item
catalogue (1,000 items with the generator's hidden 4-d factors and
popularity biases) and walks each session from a popular first item; the
next item's probability is a softmax over the catalogue of its affinity
with the current item and with a hidden per-session intent, plus the
item's popularity. Sessions last 4 to 10 items; the task is the last one.
The generator's own hit rates (it knows the intent) are printed as the
ceiling.

Two click models, each one input vector `[13 dense | 8 category ids]` (ids
as float32, exact below 2**24) so that the ONNX file has a single input:

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

The session model (GRU4Rec-style, Hidasi et al., 2016): int32 item ids,
left-padded with 0, through `Embedding(mask_zero=True)`, a GRU and a
Dense scoring every item. It trains in float32, is quantized with
`quantize_model` + `calibrate` (PTQ: the Dense head is INT8, the GRU stays
float, as TensorRT runs recurrent layers; `quantization_report` says so)
and is exported INT8 with its ONNX Runtime parity printed.

Run:

    python examples/recommender.py          # ~4.5 min on 2 cores
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
SESSION_LENGTH = 10  # items per session at most; the last is the target


def _hidden_generator(generator_seed):
    """The synthetic generator's hidden weights: dense weights, then per
    categorical field the popularity biases and 4-d factors."""
    hidden = np.random.default_rng(generator_seed)
    dense_weights = hidden.normal(0, 0.4, NUM_DENSE)
    biases = [hidden.normal(0, 0.6, v) for v in VOCAB_SIZES]
    factors = [hidden.normal(0, 0.5, (v, 4)) for v in VOCAB_SIZES]
    return dense_weights, biases, factors


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
    dense_weights, biases, factors = _hidden_generator(generator_seed)
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


def synthetic_sessions(num_sessions, seed=0, generator_seed=1234):
    """SYNTHETIC browsing sessions over the first field's 1,000 items.

    Items, their 4-d factors and popularity biases come from the click
    generator (`generator_seed`). A session starts at a popular item
    (Zipf-like, as the click data's ids) and moves on with probability
    `softmax(2 * factors @ (factors[current] + intent) + bias)`, `intent`
    a hidden 4-d vector per session. Sessions last 4 to
    `SESSION_LENGTH` items.

    Returns:
        `(history, target, oracle_rank)`: int32 `(N, SESSION_LENGTH - 1)`
        item ids + 1, left-padded with 0; the last item of each session
        (an id in [0, 1000)); the rank of the target in the generator's
        own scores (0: the generator's first choice).
    """
    _, biases, factors = _hidden_generator(generator_seed)
    items, bias = factors[0].astype("float32"), biases[0].astype("float32")
    vocab = len(items)
    rng = np.random.default_rng(seed)
    intent = rng.normal(0, 1.0, (num_sessions, 4)).astype("float32")
    walk = np.zeros((num_sessions, SESSION_LENGTH), "int64")
    walk[:, 0] = np.minimum(rng.zipf(1.3, num_sessions) - 1, vocab - 1)
    for t in range(1, SESSION_LENGTH):
        scores = 2.0 * (items[walk[:, t - 1]] + intent) @ items.T + bias
        # Inverse-CDF sampling from the softmax, one uniform per session.
        cumulative = np.cumsum(np.exp(scores - scores.max(1, keepdims=True)), 1)
        draw = rng.random((num_sessions, 1)) * cumulative[:, -1:]
        walk[:, t] = np.minimum((cumulative < draw).sum(1), vocab - 1)
    target = walk[:, -1]
    target_score = scores[np.arange(num_sessions), target]
    oracle_rank = np.sum(scores > target_score[:, None], axis=1)
    history = walk[:, :-1] + 1  # 0 is the padding id
    padding = SESSION_LENGTH - rng.integers(4, SESSION_LENGTH + 1, num_sessions)
    history[np.arange(SESSION_LENGTH - 1) < padding[:, None]] = 0
    return history.astype("int32"), target, oracle_rank


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
    1) / 2)`, the strictly upper triangle of `x @ x^T`. The batched matmul
    is a `keras.layers.Dot` sublayer: `keras_mp.quantize_model` reaches it
    inside this custom layer and puts Q/DQ on both its inputs (a matmul of
    two activations, INT8 in TensorRT), which an `ops.matmul` in `call`
    would leave in float.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.gram = layers.Dot(axes=2, name="gram")

    def call(self, inputs):
        count = inputs.shape[1]
        gram = self.gram([inputs, inputs])
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


def session_gru(vocab=VOCAB_SIZES[0], units=64):
    """Item-id history (0 = padding) -> GRU -> a score for every item."""
    inputs = keras.Input((SESSION_LENGTH - 1,), dtype="int32", name="items")
    x = layers.Embedding(
        vocab + 1, EMBEDDING_DIM * 2, mask_zero=True, name="item_embedding"
    )(inputs)
    x = layers.GRU(units, name="session_gru")(x)
    scores = layers.Dense(vocab, name="next_item")(x)
    return keras.Model(inputs, scores, name="session_gru")


def hit_rates(model, history, target):
    """Keras top-1 and top-10 hit rates of `model` on the sessions."""
    scores = model.predict(history, batch_size=2048, verbose=0)
    rank = (scores > scores[np.arange(len(target)), target, None]).sum(1)
    return float(np.mean(rank == 0)), float(np.mean(rank < 10))


def train_session_model(args, output, quick):
    """Float32 training, PTQ, INT8 ONNX export of the GRU session model."""
    sessions = 4096 if quick else 40_000
    history, target, _ = synthetic_sessions(sessions, seed=2)
    test_history, test_target, oracle = synthetic_sessions(
        2048 if quick else 10_000, seed=3
    )
    print(
        f"\nSYNTHETIC sessions from the same generator: {len(history):,} "
        f"training and {len(test_history):,} test sessions over "
        f"{VOCAB_SIZES[0]} items. The generator's own test hit rates (the "
        f"ceiling): top-1 {np.mean(oracle == 0):.1%}, top-10 "
        f"{np.mean(oracle < 10):.1%}."
    )
    keras.utils.set_random_seed(0)
    model = session_gru()
    print(f"session_gru: {model.count_params():,} parameters")
    model.compile(
        keras.optimizers.Adam(3e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(
        history,
        target,
        batch_size=256,
        epochs=1 if quick else args.epochs,
        verbose=2,
    )
    rates = {"float32": hit_rates(model, test_history, test_target)}

    int8 = keras_mp.quantize_model(model)
    keras_mp.calibrate(int8, history[:2048], method="max", verbose=0)
    rates["int8_ptq"] = hit_rates(int8, test_history, test_target)
    for name, (top1, top10) in rates.items():
        print(f"  {name} test hit rate: top-1 {top1:.1%}, top-10 {top10:.1%}")
    for row in keras_mp.quantization_report(int8, verbose=False).rows:
        if row["quantized"] or row["note"].startswith("recurrent"):
            state = "INT8" if row["quantized"] else row["note"]
            print(f"  {row['path']}: {state}")
    path = os.path.join(output, "session_gru_int8.onnx")
    parity = keras_mp.export_onnx(
        int8, path, verify_data=test_history, overwrite=True
    )
    lint = keras_mp.check_tensorrt(path)
    print(f"  wrote {path}. {parity}")
    print(
        f"  TensorRT lint: {'PASS' if lint.ok else 'FAIL'}, "
        f"{lint.weighted_ops_quantized}/{lint.weighted_ops} weighted ops "
        "INT8 (the GRU's matmuls, inside an ONNX Loop, run in float)"
    )
    return {
        "test_hit_rates": rates,
        "onnx": path,
        "parity_top1_agreement": parity.top1_agreement,
    }


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
    results["session_gru"] = train_session_model(args, args.output, args.quick)
    return results


if __name__ == "__main__":
    main()

"""Strongly typed graphs: the old "everything 16-bit" float16 pass against
float32 islands (`export_onnx(dtype=...)`), on ViT, BERT and MobileNetV2.

Each row is a tiny random-weight float model as `bench_zoo.py` builds it
(keras-hub `ViTBackbone` 32x32 and `BertBackbone` with 16 tokens, from
`hub_models`; `keras.applications.MobileNetV2`, alpha 0.35, 32x32, with
BatchNorm statistics from the inputs), and the same MobileNetV2 briefly
trained (one channel, `TRAIN_STEPS` steps of batch 128 on Fashion-MNIST
padded to 32x32, as `bench_trained_parity.py` trains it; measured on test
images): a random-weight deep network amplifies rounding chaotically,
which a trained one does not. Against the float32 Keras model, on 32
inputs, ONNX Runtime (graph optimizations off) runs:

- all16: the float32 export with every float tensor inside converted to
  float16 (`fp16.to_half` without islands: what `fp16=True` wrote
  before islands), or the error it gives;
- islands float16: `export_onnx(dtype="float16")`, magnitudes measured on
  the same inputs (threshold 512);
- islands bfloat16: `export_onnx(dtype="bfloat16")`: structure only,
  since ONNX Runtime's CPU provider has no bfloat16 arithmetic kernels.

Columns: relative L2 and max |diff| of the outputs (the worst output),
float32 nodes kept, Casts the pass added.

    python benchmarks/bench_typed.py [--quick]
"""

import os
import sys
import tempfile
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import onnx  # noqa: E402
from _common import bench_parser, markdown_table, write_results  # noqa: E402
from bench_trained_parity import Spec, build, load_data, train  # noqa: E402
from bench_zoo import (  # noqa: E402
    HUB,
    _bert_tiny_fixed,
    _images,
    _token_batch,
    refresh_batchnorm,
)

import keras_mp  # noqa: E402
from keras_mp.onnx.fp16 import to_half  # noqa: E402

SAMPLES = 32
# A few minutes on 2 CPU cores; top-1 on the test images is in the results.
TRAIN_STEPS = 300
_TRAINED = Spec("MobileNetV2", {"alpha": 0.35}, 1.0, 1, 128 * TRAIN_STEPS)


def _mobilenet_v2():
    return keras.applications.MobileNetV2(
        input_shape=(32, 32, 3),
        alpha=0.35,
        weights=None,
        classes=10,
        classifier_activation=None,
    )


class _TrainedMobileNetV2:
    """The MobileNetV2 row trained on Fashion-MNIST: `build()` trains it
    once, `data(rng, n)` gives `n` test images."""

    def __init__(self):
        (self.x, self.y), (self.xt, self.yt) = load_data(
            _TRAINED, _TRAINED.train_images, 10000
        )
        self.top1 = None

    def build(self):
        model = train(build(_TRAINED, self.x.shape[1:]), self.x, self.y, 1)
        logits = model.predict(self.xt, batch_size=500, verbose=0)
        self.top1 = float(np.mean(np.argmax(logits, -1) == self.yt))
        return model

    def data(self, rng, n):
        return self.xt[rng.choice(len(self.xt), n, replace=False)]


ROWS = {
    "ViT": HUB["ViTBackbone_tiny"],
    "BERT": (_bert_tiny_fixed, _token_batch),
    "MobileNetV2": (_mobilenet_v2, _images((32, 32, 3))),
}
TRAINED = "MobileNetV2 trained"


def _casts(proto):
    return sum(n.op_type == "Cast" for n in proto.graph.node)


def _parity(model, path, x):
    report = keras_mp.verify_onnx(model, path, x, 0.0, np.inf)
    return {"rel_l2": report.rel_l2, "max_abs_diff": report.max_abs_diff}


def _row(name, build, data, folder):
    keras.utils.set_random_seed(0)
    model = build()
    x = data(np.random.default_rng(0), SAMPLES)
    if name != TRAINED:  # a trained model keeps its own statistics
        refresh_batchnorm(model, x)
    f32 = os.path.join(folder, f"{name}_f32.onnx")
    keras_mp.export_onnx(model, f32)
    base = onnx.load(f32)
    row = {"nodes": len(base.graph.node)}
    all16 = os.path.join(folder, f"{name}_all16.onnx")
    try:
        onnx.save(to_half(base, "float16"), all16)
        row["all16"] = {
            **_parity(model, all16, x),
            "float32_nodes": 0,
            "casts": _casts(onnx.load(all16)) - _casts(base),
        }
    except ValueError as e:
        row["all16"] = {"error": str(e).split(":")[0]}
    for dtype in ("float16", "bfloat16"):
        path = os.path.join(folder, f"{name}_{dtype}.onnx")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = keras_mp.export_onnx(
                model,
                path,
                dtype=dtype,
                verify_data=x,
                max_rel_l2=np.inf,
                min_top1_agreement=0.0,
            )
        typed = keras_mp.typed_graph(path)
        entry = {
            "float32_nodes": len(typed.rows),
            "by_reason": {k: len(v) for k, v in typed.by_reason().items()},
            "casts": typed.casts,
        }
        if report is not None:
            entry.update(rel_l2=report.rel_l2, max_abs_diff=report.max_abs_diff)
        else:
            entry["parity"] = "not run: no bfloat16 kernels in ORT CPU"
        row[dtype] = entry
    return row


def _fmt(entry):
    if "error" in entry:
        return ["fails: " + entry["error"], "", "", ""]
    parity = (
        [f"{entry['rel_l2']:.2e}", f"{entry['max_abs_diff']:.3g}"]
        if "rel_l2" in entry
        else ["n/a (ORT)", "n/a"]
    )
    reasons = entry.get("by_reason")
    kept = str(entry["float32_nodes"])
    if reasons:
        kept += " (" + ", ".join(f"{k} {v}" for k, v in reasons.items()) + ")"
    return parity + [kept, str(entry["casts"])]


def main():
    args = bench_parser(__doc__, "smoke run: the ViT row only").parse_args()
    rows = dict(ROWS)
    if args.quick:
        rows = {"ViT": ROWS["ViT"]}
    else:
        trained = _TrainedMobileNetV2()
        rows[TRAINED] = (trained.build, trained.data)
    results = {"samples": SAMPLES, "train_steps": TRAIN_STEPS, "rows": {}}
    with tempfile.TemporaryDirectory() as folder:
        for name, (build_model, data) in rows.items():
            results["rows"][name] = _row(name, build_model, data, folder)
            print(name, results["rows"][name], flush=True)
    if TRAINED in results["rows"]:
        results["rows"][TRAINED]["keras_top1"] = trained.top1
    table = []
    for name, row in results["rows"].items():
        for variant, label in (
            ("all16", "everything float16 (old fp16)"),
            ("float16", "islands, float16"),
            ("bfloat16", "islands, bfloat16"),
        ):
            table.append([name, label, *_fmt(row[variant])])
    markdown = (
        "Strongly typed graphs, float models, ONNX Runtime vs the float32 "
        f"Keras model on {SAMPLES} inputs (random; Fashion-MNIST test images "
        "for the trained row), graph optimizations off.\n\n"
        + markdown_table(
            [
                "model",
                "graph",
                "rel. L2",
                "max abs diff",
                "float32 nodes",
                "Casts added",
            ],
            table,
        )
        + _notes(results)
    )
    write_results("typed", results, markdown, quick=args.quick)


def _notes(results):
    rows = results["rows"]
    if TRAINED not in rows:
        return ""
    trained, random = rows[TRAINED], rows["MobileNetV2"]
    return (
        "\n\nNotes:\n\n"
        "- The float32 nodes are the LayerNormalization, softmax and "
        "output-layer nodes (`islands.find_islands`): ViT's output is made "
        "by its `ViTEncoder`, a layer with sublayers, so only the encoder's "
        "LayerNorms and the attention softmaxes are float32, not the "
        "encoder itself; BERT keeps its pooler Dense (an output layer).\n"
        "- MobileNetV2's float16 error is the same with and without "
        "islands: its only island is the classifier's Gemm (BatchNorm is "
        "folded into the convolutions, not an island), and the error is "
        "made before it, in the 16-bit convolutions. With random weights "
        "a deep network amplifies those rounding differences chaotically "
        f"(rel. L2 {random['float16']['rel_l2']:.2e}); the same network "
        f"trained for {results['train_steps']} steps on Fashion-MNIST "
        f"(test top-1 {trained['keras_top1']:.1%} in Keras) has rel. L2 "
        f"{trained['float16']['rel_l2']:.2e} in float16.\n"
    )


if __name__ == "__main__":
    main()

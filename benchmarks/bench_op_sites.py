"""Op-level quantization on layers nobody wrote a twin for.

For each kind of layer that does its GEMMs in its own code (a hand-written
attention, `ops.dot_product_attention`, a mixture of experts, a DLRM dot
interaction, keras-hub's tied-embedding output; `op_site_models.py`):
`quantize_model` -> `calibrate` -> `.keras` round trip (`safe_mode=True`,
outputs compared bit for bit) -> `export_onnx` INT8 -> `check_tensorrt`
-> ONNX Runtime parity, and the QAT step time against the float model's,
interleaved in one run (`_timing.interleaved_fit`). Behind Q/DQ: MatMul,
Gemm and Conv nodes with a DequantizeLinear on both inputs; GEMMs the
small-GEMM rule keeps float (K or N below 16) are counted apart.

    python benchmarks/bench_op_sites.py [--quick]
"""

import os
import sys
import tempfile

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import bench_parser, markdown_table, write_results  # noqa: E402
from _timing import interleaved_fit, paired_ratio  # noqa: E402
from bench_zoo import placement  # noqa: E402
from op_site_models import (  # noqa: E402
    dlrm,
    dlrm_data,
    layer_model,
    sequences,
)

import keras_mp  # noqa: E402
from keras_mp.quantization import twins  # noqa: E402


def _tied_embedding():
    import keras_hub

    keras.utils.set_random_seed(0)
    tokens = keras.Input((8,), dtype="int32")
    embedding = keras_hub.layers.ReversibleEmbedding(256, 64, name="embed")
    x = keras.layers.Dense(64, activation="gelu", name="mix")(embedding(tokens))
    model = keras.Model(tokens, embedding(x, reverse=True))
    data = np.random.default_rng(0).integers(0, 256, (64, 8)).astype("int32")
    return model, data


KINDS = {
    "hand-written attention (ops.matmul, @)": lambda: (
        layer_model("hand"),
        sequences(64),
    ),
    "ops.dot_product_attention (causal)": lambda: (
        layer_model("fused"),
        sequences(64),
    ),
    "mixture of experts (ops.einsum)": lambda: (
        layer_model("experts"),
        sequences(64),
    ),
    "DLRM dot interaction": lambda: (dlrm(), dlrm_data(64)),
    "tied embedding output (keras-hub)": _tied_embedding,
}


def _targets(model, x):
    y = keras.ops.convert_to_numpy(model(x))
    return np.random.default_rng(1).normal(size=y.shape).astype("float32")


def measure(name, make, directory, steps):
    model, x = make()
    qmodel = keras_mp.quantize_model(model)
    keras_mp.calibrate(qmodel, x, verbose=0)
    path = os.path.join(directory, "q.keras")
    qmodel.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    same = np.array_equal(
        keras.ops.convert_to_numpy(loaded(x)),
        keras.ops.convert_to_numpy(qmodel(x)),
    )
    onnx_path = os.path.join(directory, "q.onnx")
    keras_mp.export_onnx(qmodel, onnx_path, overwrite=True)
    found = placement(onnx_path)
    parity = keras_mp.verify_onnx(
        qmodel, onnx_path, x, min_top1_agreement=0.0, max_rel_l2=1e9
    )
    sites = [
        key
        for layer in twins.quantized_layers(qmodel)
        for key, _, _ in layer.site_quantizers()
    ]
    y = _targets(model, x)
    float_model, _ = make()
    runs = {}
    for key, m in (("float", float_model), ("qat", qmodel)):
        m.compile(keras.optimizers.SGD(1e-3), "mse")
        runs[key] = (m, [])
    reps = max(1, steps // (len(x) // 16))
    xs, ys = np.concatenate([x] * reps), np.concatenate([y] * reps)
    timers = interleaved_fit(runs, xs, ys, 16, steps, max(4, steps // 4))
    _, ratio, _ = paired_ratio(timers, "float", "qat")
    return {
        "kind": name,
        "op_site_quantizers": len(sites),
        "weighted_ops": found["weighted_ops"],
        "weighted_quantized": found["weighted_quantized"],
        "small_gemms": found["small_gemms"],
        "coverage": found["coverage"],
        "coverage_by_rule": found["coverage_by_rule"],
        "lint_ok": found["lint_ok"],
        "round_trip_exact": bool(same),
        "rel_l2": float(parity.rel_l2),
        "qat_step_ratio": ratio,
    }


def markdown(rows):
    header = [
        "layer kind",
        "op-site quantizers",
        "GEMMs behind Q/DQ",
        "of those not kept float by the small-GEMM rule",
        "lint",
        "`.keras` round trip",
        "ORT rel. L2",
        "QAT step / float step",
    ]
    table = [
        [
            r["kind"],
            r["op_site_quantizers"],
            f"{r['weighted_quantized']}/{r['weighted_ops']}",
            f"{100 * r['coverage_by_rule']:.0f}%",
            "PASS" if r["lint_ok"] else "FAIL",
            "exact" if r["round_trip_exact"] else "**differs**",
            f"{r['rel_l2']:.1e}",
            f"{r['qat_step_ratio']:.2f}",
        ]
        for r in rows
    ]
    return (
        "Op-level quantization (`keras_mp/quantization/op_sites.py`) on "
        "layers with no twin class: INT8, max calibration on 64 random "
        "inputs, ONNX Runtime with graph optimizations off, QAT step time "
        "against the float model's in interleaved `fit` turns (batch 16, "
        "2 CPU cores).\n\n" + markdown_table(header, table)
    )


def main():
    parser = bench_parser(__doc__, "smoke run: 8 QAT steps instead of 64")
    args = parser.parse_args()
    steps = 8 if args.quick else 64
    rows = []
    for name, make in KINDS.items():
        with tempfile.TemporaryDirectory() as directory:
            rows.append(measure(name, make, directory, steps))
            print(rows[-1], flush=True)
    write_results("op_sites", {"rows": rows}, markdown(rows), quick=args.quick)


if __name__ == "__main__":
    main()

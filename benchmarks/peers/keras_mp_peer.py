"""Peer benchmark (main venv): keras_mp PTQ and QAT from the shared float model.

- PTQ: `quantize_model` + `calibrate` with each calibrator (max,
  percentile, entropy, mse, auto) on the shared calibration images; the best is
  chosen by top-1 on the validation slice (never on the test set).
- QAT: the model calibrated with percentile (keras_mp's QAT recipe, see
  bench_quantization) fine-tuned 1 epoch with Adam and a cosine decay from
  `--lr`; the float32 control is the float model fine-tuned identically
  without quantization. Both are fine-tuned afresh on each of
  `--qat-seeds` fine-tune orders (`_peer_common.finetune_arrays`: order 0
  is the shared fixed order, order k its permutation with seed k; the same
  batches as tfmot's) with the Keras seed `--seed` + 1 + k, and their
  Keras test top-1 is recorded per order (`runs`) with its mean and sd.
- The order-0 models are the ones exported and timed: step time is QAT
  `train_on_batch` / float32 control `train_on_batch`, interleaved rounds
  on one batch; `keras_mp_ptq.onnx` and `keras_mp_qat.onnx` are written
  with `keras_mp.export_onnx` (parity checked on validation images).

Writes `keras_mp.json` in the work folder.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
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

import keras_mp  # noqa: E402
from keras_mp.reference import (  # noqa: E402
    QAT_CALIBRATOR,
    compile_classifier,
    cosine_adam,
)

METHODS = ("max", "percentile", "entropy", "mse", "auto")


def top1(model, x, y):
    _, acc = model.evaluate(x, y, batch_size=1000, verbose=0)
    return round(100 * float(acc), 2)


def fresh_control(fmodel, optimizer):
    """The float32 control: a copy of the float model, compiled to fine-tune."""
    control = keras.models.clone_model(fmodel)
    control.set_weights(fmodel.get_weights())
    return compile_classifier(control, optimizer=optimizer)


def fresh_qat(fmodel, x_calib, optimizer):
    """A QAT copy of the float model, calibrated, compiled to fine-tune."""
    # QAT starts from percentile calibration, the recipe measured in
    # bench_quantization (tighter ranges than max give the fine-tune finer
    # steps), whatever calibrator PTQ preferred.
    qat = keras_mp.quantize_model(fmodel)
    keras_mp.calibrate(qat, x_calib, method=QAT_CALIBRATOR, verbose=0)
    return compile_classifier(qat, optimizer=optimizer)


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
    d = load_data(a.workdir)
    w = a.workdir
    fmodel = keras.models.load_model(os.path.join(w, "float.keras"))
    compile_classifier(fmodel)
    out = {"float_keras_test_top1": top1(fmodel, d["x_test"], d["y_test"])}

    ptq, qmodels = {}, {}
    for method in METHODS:
        start = time.perf_counter()
        q = keras_mp.quantize_model(fmodel)
        keras_mp.calibrate(q, d["x_calib"], method=method, verbose=0)
        seconds = time.perf_counter() - start
        compile_classifier(q)
        ptq[method] = {
            "val_top1": top1(q, d["x_val"], d["y_val"]),
            "keras_test_top1": top1(q, d["x_test"], d["y_test"]),
            "quantize_and_calibrate_seconds": round(seconds, 2),
        }
        qmodels[method] = q
        print(f"PTQ {method}: {ptq[method]}")
    best = max(METHODS, key=lambda m: ptq[m]["val_top1"])  # ties: first
    out["ptq"] = ptq
    out["best_ptq_method"] = best
    out["best_ptq_selected_by"] = "validation top-1"
    parity = keras_mp.export_onnx(
        qmodels[best],
        os.path.join(w, "keras_mp_ptq.onnx"),
        verify_data=d["x_val"][:1000],
        overwrite=True,
    )
    out["ptq_parity"] = str(parity)

    steps = -(-len(d["finetune_order"]) // BATCH)

    def optimizer():
        return cosine_adam(steps, a.lr)

    runs, first = finetune_orders(
        d,
        a.qat_seeds,
        a.seed,
        keras.utils.set_random_seed,
        {
            "control": lambda: fresh_control(fmodel, optimizer()),
            "qat": lambda: fresh_qat(fmodel, d["x_calib"], optimizer()),
        },
        top1,
    )
    (control, control_s), (qat, qat_s) = first["control"], first["qat"]
    parity = keras_mp.export_onnx(
        qat,
        os.path.join(w, "keras_mp_qat.onnx"),
        verify_data=d["x_val"][:1000],
        overwrite=True,
    )
    out["qat_parity"] = str(parity)
    out["runs"] = runs
    out["control"] = {
        **order_summary(runs, "control"),
        "finetune_seconds": control_s,
    }
    out["qat"] = {
        "start": QAT_CALIBRATOR,
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
    write_json(w, "keras_mp", out)


if __name__ == "__main__":
    main()

"""Interrupted training resumes where it stopped, with the same state.

A real training process (`resume_worker.py`) is stopped mid-epoch by a
signal: SIGINT (Ctrl-C, Python unwinds) for QAT + 2:4 + loss scaling,
SIGKILL (OOM killer, preemption: nothing runs) for MuPPET. A new process
resumes it with `keras.callbacks.BackupAndRestore` and must end with the
same masks, ranges, loss scale, precision level and policy state as an
uninterrupted run with the same seed, and, TensorFlow op determinism being
on in the workers, the same weights bit for bit.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.integration import resume_worker as rw

WORKER = os.path.join(os.path.dirname(__file__), "resume_worker.py")
SIGNALS = {"sparse_qat": signal.SIGINT, "muppet": signal.SIGKILL}
TIMEOUT = 400


def _start(scenario, mode, out_dir):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    env.pop("TF_CONFIG", None)
    with open(os.path.join(out_dir, f"{mode}.log"), "w") as log:
        return subprocess.Popen(
            [sys.executable, WORKER, scenario, mode, str(out_dir)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _log_tail(out_dir, mode):
    with open(os.path.join(out_dir, f"{mode}.log")) as f:
        return f.read()[-3000:]


def _wait_ready(procs, dirs):
    deadline = time.monotonic() + TIMEOUT
    pending = set(procs)
    while pending:
        for name in list(pending):
            if os.path.exists(os.path.join(dirs[name], "ready")):
                pending.discard(name)
            elif procs[name].poll() is not None:
                pytest.fail(
                    f"{name} worker exited before the kill point:\n"
                    + _log_tail(dirs[name], "interrupt")
                )
        if time.monotonic() > deadline:
            pytest.fail(f"workers never reached the kill point: {pending}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Interrupts both scenarios, resumes them; returns what happened."""
    dirs = {name: tmp_path_factory.mktemp(name) for name in rw.SCENARIOS}
    procs = {name: _start(name, "interrupt", d) for name, d in dirs.items()}
    try:
        _wait_ready(procs, dirs)
    except BaseException:
        for proc in procs.values():
            proc.kill()
        raise
    out = {}
    for name, proc in procs.items():
        with open(os.path.join(dirs[name], "ready")) as f:
            stopped_at = json.load(f)
        proc.send_signal(SIGNALS[name])
        code = proc.wait(60)
        with open(dirs[name] / "backup" / "training_metadata.json") as f:
            checkpoint = json.load(f)
        out[name] = {
            "stopped_at": stopped_at,
            "exit_code": code,
            "checkpoint": checkpoint,
        }
    resumed = {name: _start(name, "resume", d) for name, d in dirs.items()}
    for name, proc in resumed.items():
        try:
            code = proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        if code != 0:
            pytest.fail(
                f"{name} resume failed:\n" + _log_tail(dirs[name], "resume")
            )
        for kind in ("resumed", "reference"):
            with np.load(dirs[name] / f"{kind}.npz") as data:
                out[name][kind] = dict(data)
        out[name]["backup_left"] = os.path.exists(dirs[name] / "backup")
    return out


@pytest.mark.parametrize("name", list(rw.SCENARIOS))
def test_signal_stopped_the_process_mid_epoch(runs, name):
    run = runs[name]
    epoch, batch = rw.KILL_AT[name]
    assert run["stopped_at"] == {"epoch": epoch, "batch": batch}
    assert run["exit_code"] != 0  # it died; it did not finish
    # The newest checkpoint is the end of the epoch before the kill: the
    # batches already run in the killed epoch are lost and run again.
    assert run["checkpoint"]["epoch"] == epoch


BOTH = ["sparse_qat", "muppet"]


@pytest.mark.parametrize("name", list(rw.SCENARIOS))
def test_resume_skips_finished_epochs_and_cleans_up(runs, name):
    run = runs[name]
    epoch, _ = rw.KILL_AT[name]
    # Only the epochs after the checkpoint ran again: it resumed, it did
    # not silently start over.
    assert len(run["resumed"]["loss"]) == rw.EPOCHS - epoch
    assert len(run["reference"]["loss"]) == rw.EPOCHS
    assert not run["backup_left"]  # finished: BackupAndRestore removed it


@pytest.mark.parametrize("name", BOTH)
def test_resumed_losses_equal_the_uninterrupted_run(runs, name):
    epoch, _ = rw.KILL_AT[name]
    np.testing.assert_array_equal(
        runs[name]["resumed"]["loss"], runs[name]["reference"]["loss"][epoch:]
    )


def _same(run, prefix):
    resumed, reference = run["resumed"], run["reference"]
    keys = sorted(k for k in reference if k.startswith(prefix))
    assert keys, f"no {prefix} state recorded"
    assert sorted(k for k in resumed if k.startswith(prefix)) == keys
    for key in keys:
        np.testing.assert_array_equal(resumed[key], reference[key], key)
    return keys


def test_qat_ranges_identical(runs):
    keys = _same(runs["sparse_qat"], "range/")
    assert any(k.endswith("/input_0") for k in keys)  # activation ranges
    assert any(k.endswith("/kernel") for k in keys)  # weight ranges


def test_2_4_masks_identical_and_valid(runs):
    from keras_mp.sparsity.masks import is_2_4_sparse

    run = runs["sparse_qat"]
    keys = _same(run, "mask/")
    assert set(keys) == {"mask/conv_a", "mask/conv_b", "mask/head"}
    _same(run, "kept/")
    for key in keys:
        axis = 0 if key == "mask/head" else -2
        assert is_2_4_sparse(run["resumed"][key], axis)


def test_loss_scale_and_skipped_steps_identical(runs):
    run = runs["sparse_qat"]
    for key in ("loss_scale", "skipped_steps", "iterations"):
        assert run["resumed"][key] == run["reference"][key], key
    # The run is non-trivial: the scale grew and overflowed along the way.
    assert run["reference"]["skipped_steps"] > 0
    assert run["reference"]["loss_scale"] != 2.0**15


def test_precision_level_and_switch_state_identical(runs):
    run = runs["muppet"]
    _same(run, "word_length/")
    for key in ("stage", "violations", "window_epochs", "held_learning_rate"):
        _same(run, f"precision/{key}")
    epoch, _ = rw.KILL_AT["muppet"]
    reference = run["reference"]["precision_history"]
    # The switch 6 -> 8 bits came before the kill; the resumed run
    # continues at 8 bits from the checkpoint.
    assert list(reference[:epoch]) == [6.0] * epoch
    np.testing.assert_array_equal(
        run["resumed"]["precision_history"], reference[epoch:]
    )
    assert reference[epoch] == 8.0


def test_switching_policy_measurements_identical(runs):
    _same(runs["muppet"], "precision/max_diversity")


@pytest.mark.parametrize("name", BOTH)
def test_final_weights_identical(runs, name):
    _same(runs[name], "weight/")

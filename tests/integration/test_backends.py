"""keras_mp under another Keras backend (issue 34, item 9).

keras_mp is TensorFlow code: its quantizers, layers, callbacks, loss
scaling and export refuse any other backend with one error that names it
and says how to switch (`keras_mp._compat.require_tensorflow`), before
changing or writing anything; import, the reports and the
backend-neutral helpers keep working. `backend_worker.py` checks that in
a process of its own (a Keras backend is chosen once per process); this
test then follows the error's advice: the float model the worker trained
and saved loads here, under TensorFlow, and quantizes.
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
WORKER = os.path.join(os.path.dirname(__file__), "backend_worker.py")


@pytest.mark.parametrize("backend", ["jax", "numpy"])
def test_other_backend_refused_once_and_clearly(backend, tmp_path):
    env = dict(
        os.environ,
        KERAS_BACKEND=backend,
        TF_CPP_MIN_LOG_LEVEL="2",
        CUDA_VISIBLE_DEVICES="",
        JAX_PLATFORMS="cpu",
        # The checkout's keras_mp, whichever one is installed.
        PYTHONPATH=os.pathsep.join(
            [ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]
        ),
    )
    proc = subprocess.run(
        [sys.executable, WORKER, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "result.json") as f:
        result = json.load(f)
    assert result["backend"] == backend
    assert result["failures"] == []

    model = keras.saving.load_model(tmp_path / "float.keras")
    qmodel = keras_mp.quantize_model(model)
    x = np.random.default_rng(0).random((32, 32), dtype=np.float32)
    keras_mp.calibrate(qmodel, x, verbose=0)
    assert keras_mp.quantization_report(qmodel, verbose=False).rows


def test_tensorflow_backend_passes():
    """The check is silent on TensorFlow (every other test runs there)."""
    from keras_mp._compat import require_tensorflow

    assert keras.config.backend() == "tensorflow"
    assert require_tensorflow("keras_mp.quantize_model") is None

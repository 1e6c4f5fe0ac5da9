"""Step timing inside `fit`, with runs interleaved so a noisy machine's
drift hits every model alike.

Step times on the 2-core VMs these benchmarks run on drift by up to 40 %
over minutes (140 -> 95 ms for the same step within one run), so timing
one model's epoch and then another's measures the drift as much as the
models. `interleaved_fit` trains the models on the same batches in turns
of `chunk_steps` steps (A-B, B-A, ...); each `fit` call continues the
optimizer's step count and learning-rate schedule, so the training equals
one uninterrupted run (per-epoch and train-begin/end hooks of other
callbacks, e.g. EarlyStopping, fire on every turn instead: pass only
callbacks that act per batch).
"""

import time

import keras
import numpy as np


class StepTimer(keras.callbacks.Callback):
    """Wall time of every training step inside `fit`, grouped in turns."""

    def __init__(self):
        super().__init__()
        self.times, self.total, self.chunks = [], 0.0, []

    def new_chunk(self):
        self.chunks.append([])

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        step = time.perf_counter() - self._start
        self.times.append(step)
        self.total += step
        if self.chunks:
            self.chunks[-1].append(step)

    def median(self):
        """Median step, leaving out the first two of each turn (trace,
        iterator warm-up)."""
        steady = [t for c in self.chunks for t in c[2:]] or self.times[2:]
        return float(np.median(steady or self.times))

    def chunk_medians(self):
        return [float(np.median(c[2:] or c)) for c in self.chunks]


def interleaved_fit(runs, x, y, batch_size, steps, chunk_steps):
    """Trains every model of `runs` ({name: (model, callbacks)}, compiled)
    on the same `steps` batches of `x, y` in order, alternating every
    `chunk_steps` steps. Returns {name: StepTimer}."""
    timers = {name: StepTimer() for name in runs}
    names = list(runs)
    for i, start in enumerate(range(0, steps, chunk_steps)):
        rows = slice(start * batch_size, (start + chunk_steps) * batch_size)
        for name in names if i % 2 == 0 else names[::-1]:
            model, callbacks = runs[name]
            timers[name].new_chunk()
            model.fit(
                x[rows],
                y[rows],
                batch_size=batch_size,
                epochs=1,
                shuffle=False,
                verbose=0,
                # first, so the other callbacks' batch hooks are timed too
                callbacks=[timers[name]] + list(callbacks),
            )
    return timers


def paired_ratio(timers, a, b):
    """Step-time ratio b/a: `(per-turn ratios, their median, ratio of the
    overall medians)`."""
    per_turn = [
        q / c
        for q, c in zip(timers[b].chunk_medians(), timers[a].chunk_medians())
    ]
    return (
        per_turn,
        float(np.median(per_turn)),
        timers[b].median() / timers[a].median(),
    )

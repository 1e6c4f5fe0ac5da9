"""`StructuredSparsity`: the 2:4 pruning callback for `model.fit`."""

import warnings

import keras

from keras_mp import _keras, _models, _record
from keras_mp._compat import require_tensorflow
from keras_mp.sparsity.masks import (
    SCHEDULES,
    SparsityMask,
    check_m_n,
    pattern_level,
    pruning_mask,
    value,
)
from keras_mp.sparsity.model import (
    check_eligible,
    prunable_kernel,
    select_layers,
)
from keras_mp.sparsity.report import sparsity_report
from keras_mp.sparsity.saving import attach_mask


@keras.saving.register_keras_serializable(package="keras_mp")
class StructuredSparsity(keras.callbacks.Callback):
    """Prunes kernels to m:n structured sparsity (2:4 for TensorRT) in `fit`.

    Masks keep the `m` largest |w| of every group of `n` consecutive input
    channels (ties to the lower index). Each pruned kernel gets a
    `SparsityMask` constraint, applied by the optimizer after every update
    inside the compiled train step (also with `steps_per_execution > 1`,
    XLA and `tf.distribute`). The masks are saved with the model and stay
    on after `fit`: call `strip_sparsity` to export. How and when the masks
    are made: `docs/sparsity.md`. Layers inside custom layers, subclassed
    models and keras-hub backbones are pruned too. Their parent's code
    rebuilds them on load without the constraint, so a bare `.keras` file
    of such a model keeps their zeros (in the weights) but not their
    masks (a warning says so); a `keras_mp.RecordedModel` around the model
    keeps the masks too, for code that loads it without this callback.

    A kernel that has no mask when the callback attaches but exact zeros
    in every group (a pruned kernel reloaded as above, or loaded with
    `load_weights` before the callback attached) gets its mask back from
    them: the same mask and schedule progress, so training continues as
    if uninterrupted; only its `kept_magnitude` is unknown (NaN). A mask
    is never loosened: if the schedule asks for more weights than a mask
    keeps (an optimizer step that was not restored), the mask stays and
    a warning says so. Dense weights attached after the schedule reached
    m:n are pruned again in one shot, with a warning (not for one-shot
    pruning from `begin_step=0`, which means "when fit starts").

    Layers that cannot be pruned are skipped and listed in `self.report`
    (a `SparsityReport`): input channels not a multiple of `n` (this
    includes a first conv on gray or RGB input), depthwise convolutions,
    unsupported layer types. With `pad=True` a channel count that is not a
    multiple of `n` is treated as zero-padded instead. With
    `skip_unaligned=True` the callback also leaves dense the layers NVIDIA
    ASP leaves dense: output channels not a multiple of 8 or input channels
    not a multiple of 16 (a 10-way classifier, for one). Sparse Tensor Core
    kernels do not take those shapes, so pruning them costs accuracy and
    gains no speed.

    Args:
        m: int. Weights kept per group. Defaults to 2.
        n: int. Group size. Defaults to 4.
        schedule: str. `"one_shot"`: prune to m:n at `begin_step` and keep
            the masks fixed. `"gradual"`: from dense at `begin_step`, keep
            one weight fewer per group at evenly spaced steps until m:n at
            `end_step` (2:4 goes dense -> 3:4 -> 2:4). Defaults to
            `"one_shot"`.
        begin_step: int. Optimizer step (`optimizer.iterations`) at which
            pruning starts. Defaults to 0.
        end_step: int. Step at which `"gradual"` reaches m:n; required for
            it, not allowed with `"one_shot"`. Defaults to None.
        layers: which layers to prune: a layer name or regex (str, matched
            in full), a layer class, a callable `f(layer) -> bool`, or a
            list of these. Defaults to None: every supported layer.
        pad: bool. Zero-pad channel counts that are not a multiple of `n`.
            Defaults to False.
        skip_unaligned: bool. Skip layers whose output channels are not a
            multiple of 8 or whose input channels are not a multiple of 16
            (NVIDIA ASP's rule). Defaults to False: prune every layer whose
            input channels are a multiple of `n`.
        verbose: int. 1 prints the skipped layers when fit starts.
            Defaults to 0.

    Raises:
        ValueError: bad `m`/`n`, unknown `schedule`, bad steps, or (when
            `fit` starts) a `layers` selection that matches no layer or
            selects no layer that can be pruned (the message lists each
            layer's reason).

    Example:

    >>> model.fit(x, y, epochs=3)  # doctest: +SKIP
    >>> sparsity = keras_mp.StructuredSparsity()  # doctest: +SKIP
    >>> model.fit(x, y, epochs=3, callbacks=[sparsity])  # doctest: +SKIP
    >>> print(sparsity.report)  # doctest: +SKIP
    >>> deploy = keras_mp.strip_sparsity(model)  # doctest: +SKIP
    """

    def __init__(
        self,
        m=2,
        n=4,
        schedule="one_shot",
        begin_step=0,
        end_step=None,
        layers=None,
        pad=False,
        skip_unaligned=False,
        verbose=0,
    ):
        require_tensorflow("keras_mp.StructuredSparsity")
        super().__init__()
        check_m_n(m, n)
        if schedule not in SCHEDULES:
            raise ValueError(
                f"`schedule` must be one of {SCHEDULES}. "
                f"Received: schedule={schedule!r}"
            )
        if not isinstance(begin_step, int) or begin_step < 0:
            raise ValueError(
                "`begin_step` must be an integer >= 0. "
                f"Received: begin_step={begin_step!r}"
            )
        if schedule == "gradual" and (
            not isinstance(end_step, int) or end_step <= begin_step
        ):
            raise ValueError(
                "schedule='gradual' needs an integer `end_step` greater than "
                f"`begin_step`. Received: begin_step={begin_step}, "
                f"end_step={end_step!r}"
            )
        if schedule == "one_shot" and end_step is not None:
            raise ValueError(
                "`end_step` only applies to schedule='gradual'; one_shot "
                f"prunes at `begin_step`. Received: end_step={end_step!r}"
            )
        self.m = m
        self.n = n
        self.schedule = schedule
        self.begin_step = begin_step
        self.end_step = end_step
        self.layers = layers
        self.pad = pad
        self.skip_unaligned = skip_unaligned
        self.verbose = verbose
        self._targets = []
        self._done = False
        self._relaxed_warned = False

    def kept_at(self, step):
        """Weights kept per group that the schedule asks for at `step`."""
        if step < self.begin_step:
            return self.n
        if self.schedule == "one_shot" or step >= self.end_step:
            return self.m
        stages = self.n - self.m
        done = (
            stages
            * (step - self.begin_step)
            // (self.end_step - self.begin_step)
        )
        return self.n - done

    def set_model(self, model):
        super().set_model(model)
        # `fit` builds the model before it calls `set_model`, and calls
        # `set_model` on every callback before any `on_train_begin`.
        if model.built:
            self._attach()

    def on_train_begin(self, logs=None):
        if not self._targets:
            self._attach()

    def _attach(self):
        model = self.model
        chosen = select_layers(model, self.layers)
        self._targets, self._done, added = [], False, False
        self._relaxed_warned = False
        verdicts = [
            check_eligible(x, self.m, self.n, self.pad, self.skip_unaligned)
            for x in chosen
        ]
        if not any(verdict.ok for verdict in verdicts):
            reasons = "; ".join(
                f"{layer.name}: {verdict.reason}"
                for layer, verdict in zip(chosen, verdicts)
            )
            raise ValueError(
                f"StructuredSparsity found no layer of model '{model.name}' "
                f"that can be pruned to {self.m}:{self.n}, so `fit` would "
                "train it dense. "
                + (f"Skipped: {reasons}." if chosen else "It has no kernel.")
            )
        step = self._step()
        repruned = []
        for layer, verdict in zip(chosen, verdicts):
            if not verdict.ok:
                self._warn_if_masked(layer, verdict.reason)
                continue
            weight = verdict.value
            kernel = getattr(layer, weight.attr)
            constraint = kernel.constraint
            if not self._reusable(constraint, weight.in_axis):
                earlier = isinstance(constraint, SparsityMask)
                if earlier:
                    constraint = constraint.constraint
                with model.distribute_strategy.scope():
                    constraint = SparsityMask(
                        kernel.shape,
                        weight.in_axis,
                        self.m,
                        self.n,
                        self.pad,
                        constraint=constraint,
                    )
                attach_mask(layer, constraint)
                added = True
                if not earlier and not self._restore(kernel, constraint, step):
                    repruned.append(layer.name)
            self._targets.append((kernel, constraint))
        if repruned and self._finished_before(step):
            self._warn_repruned(model, repruned, step)
        if added:
            # A train step traced before the constraints existed (an earlier
            # `fit`) would not apply them: `fit` traces it again.
            _models.reset_compiled_functions(model)
            self._warn_if_not_saved(model)
        if self.verbose:
            skipped = [r for r in self.report.rows if not r.eligible]
            for row in skipped:
                print(f"StructuredSparsity: skipping {row.name}: {row.reason}")

    def _step(self):
        """`optimizer.iterations`, or None for a model not compiled yet."""
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is None:
            return None
        return int(value(optimizer.iterations))

    def _restore(self, kernel, constraint, step):
        """Gives a new mask the pattern of a kernel pruned before it had one
        (a bare `.keras` reload of a nested layer, `load_weights` before the
        callback attached, any copy of the weights): its exact zeros, at
        the level the schedule is at (or the kernel's, when it holds more
        non-zeros: a schedule step between two batch calls). Returns False,
        leaving the mask dense, for a kernel without such zeros."""
        level, dense = pattern_level(
            value(kernel), constraint.axis, self.n, self.pad
        )
        if not 0 < level < dense:
            return False  # dense, or all zeros (an initializer, not a prune)
        target = self.n if step is None else self.kept_at(step)
        constraint.restore(
            kernel, max(level, target if target < self.n else self.m)
        )
        return level <= target

    def _finished_before(self, step):
        """Whether a batch of `fit` ran at a step where the schedule had
        reached m:n, before `step`. One-shot pruning from `begin_step=0`
        (the default) means "prune when fit starts": never."""
        if step is None or (self.schedule, self.begin_step) == ("one_shot", 0):
            return False
        spe = int(getattr(self.model, "steps_per_execution", 1) or 1)
        return step - spe >= self._full_step

    @property
    def _full_step(self):
        """The step at which the schedule reaches m:n."""
        return self.end_step if self.schedule == "gradual" else self.begin_step

    def _warn_repruned(self, model, names, step):
        last = self._full_step
        warnings.warn(
            f"StructuredSparsity: model '{model.name}' is at step {step} "
            f"(optimizer.iterations), after its {self.schedule} schedule "
            f"reached {self.m}:{self.n} at step {last}, but these kernels "
            f"are not {self.m}:{self.n} sparse and have no mask: "
            f"{', '.join(names)}. They are pruned again in one shot from "
            "their magnitudes at the next batch. If you meant to resume a "
            "pruned run, these are not its weights (dense weights loaded?): "
            "load the pruned weights, or a `keras_mp.RecordedModel` file, "
            "instead.",
            stacklevel=4,
        )

    def _warn_if_not_saved(self, model):
        if isinstance(model, _record.RecordedModel):
            return  # its config records every mask
        masked = {id(kernel) for kernel, _ in self._targets}
        lost = [
            layer.name
            for layer, parents in _models.walk_layers(model, with_parents=True)
            if id(prunable_kernel(layer)) in masked
            and not all(map(_keras.is_plain_graph_model, (model, *parents)))
        ]
        if lost:
            warnings.warn(
                f"StructuredSparsity: saved as .keras, model '{model.name}' "
                "keeps the zeros of these layers' kernels (in the weights) "
                "but not their SparsityMask constraints (their parent's "
                f"code rebuilds them on load without it): {', '.join(lost)}. "
                "A StructuredSparsity attached again (`fit` with it, or "
                "`set_model`) restores each mask from its kernel's zeros; "
                "the kept |w| share is then unknown, and until then an "
                "optimizer step fills the zeros. To keep the masks "
                "themselves, for code that loads the model without the "
                "callback (training, inference or checks that must see the "
                "masks, `sparse_layers`, `sparsity_report`), save "
                "`keras_mp.RecordedModel(model)` instead.",
                stacklevel=4,
            )

    @staticmethod
    def _warn_if_masked(layer, reason):
        if pruning_mask(prunable_kernel(layer)) is not None:
            warnings.warn(
                f"StructuredSparsity: layer '{layer.name}' is skipped here "
                f"({reason}) but still carries the SparsityMask of an "
                "earlier pruning, which keeps applying. Prune with the "
                "earlier settings, or start from `strip_sparsity(model)` "
                "and retrain that layer dense.",
                stacklevel=3,
            )

    @property
    def report(self):
        """A `SparsityReport` of the selected layers, as they are now."""
        if self.model is None:
            return None
        return sparsity_report(
            self.model,
            self.m,
            self.n,
            layers=self.layers,
            pad=self.pad,
            skip_unaligned=self.skip_unaligned,
        )

    def _reusable(self, constraint, axis):
        return (
            isinstance(constraint, SparsityMask)
            and (constraint.m, constraint.n) == (self.m, self.n)
            and constraint.axis == axis % len(constraint.shape)
            and constraint.pad == self.pad
        )

    def on_train_batch_begin(self, batch, logs=None):
        if self._done:
            return
        step = int(value(self.model.optimizer.iterations))
        target = self.kept_at(step)
        relaxed = []
        for kernel, constraint in self._targets:
            kept = int(value(constraint.kept))
            if kept < target:
                relaxed.append(kernel.path)  # pruning never loosens a mask
            elif kept > target:
                constraint.prune(kernel, target)
        if relaxed and not self._relaxed_warned:
            self._relaxed_warned = True
            warnings.warn(
                f"StructuredSparsity: at step {step} (optimizer.iterations) "
                f"the {self.schedule} schedule keeps {target} of "
                f"{self.n} weights per group, but these kernels are already "
                f"pruned further: {', '.join(relaxed)}. Their masks stay as "
                "they are (pruning never loosens a mask); the schedule takes "
                "over when it reaches their level. If you meant to resume a "
                "pruned run, its optimizer step was not restored: load the "
                "`.keras` file with its optimizer, or build the optimizer "
                "(`model.optimizer.build(model.trainable_variables)`) "
                "before `load_weights`.",
                stacklevel=2,
            )
        self._done = target == self.m

    def get_config(self):
        layers = self.layers
        if isinstance(layers, (list, tuple)):
            layers = list(layers)
        names = [layers] if isinstance(layers, str) else layers or []
        if not (
            isinstance(names, list) and all(isinstance(x, str) for x in names)
        ):
            raise ValueError(
                "StructuredSparsity.get_config: a `layers` selection by class "
                "or callable cannot be serialized. Select the layers by name "
                f"or regex to serialize this callback. Received: "
                f"layers={self.layers!r}"
            )
        return {
            "m": self.m,
            "n": self.n,
            "schedule": self.schedule,
            "begin_step": self.begin_step,
            "end_step": self.end_step,
            "layers": layers,
            "pad": self.pad,
            "skip_unaligned": self.skip_unaligned,
            "verbose": self.verbose,
        }

    @classmethod
    def from_config(cls, config):
        return cls(**config)

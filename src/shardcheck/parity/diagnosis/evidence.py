"""The evidence of a parity comparison: per-leaf errors, per-step records, and the findings read from them.

:class:`LeafError` is one leaf's error at one step, :class:`StepRecord` everything compared at one step, and
:class:`Diagnosis` one finding. The live comparison (``parity.comparison.live``) and the digest comparison of a
replay both emit these records; :mod:`~shardcheck.parity.diagnosis.localization` and the catalog of
:mod:`~shardcheck.parity.diagnosis.rules` read them. :func:`constant_ratio` decides whether a leaf's median ratio
is one factor across the leaf.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

KINDS = ("loss", "grad", "param", "opt_state", "counter")
# Two update ratios "agree" when within 2% of each other.
RATIO_RTOL = 0.02
# A leaf's median ratio is a constant factor only when its 10th and 90th percentile (``LeafError.spread``) lie within
# this many of the ratio's own tolerances of it (or within RATIO_RTOL of it, whichever is wider).
SPREAD_TOLS = 3.0


@dataclasses.dataclass(frozen=True)
class LeafError:
    """The error of one leaf at one step.

    Attributes:
        step: the 0-based step index t.
        kind: ``"loss"``, ``"grad"``, ``"param"``, ``"opt_state"``, ``"counter"`` (exact integer leaves: the
            NNX step counter, Adam's ``count``, the model's integer state ``model.<path>``) or ``"state"`` (the
            model's floating state that is not a parameter, ``model.<path>``, by
            :mod:`shardcheck.parity.comparison.model_state`'s rule: exact where the reference's step leaves it as
            it was and the loss reads it; not compared, ``tolerance`` inf, where only the candidate's writes it
            and the loss does not read it; on its change within half the reference's largest where both write
            it).
        path: the leaf's dotted path, e.g. ``"hidden.kernel"`` or ``"0.mu.bias"`` (``"loss"``, ``"step"``).
        max_abs_err: ``max |candidate - reference|`` over the leaf's elements (float64 arithmetic).
        max_rel_err: ``max_abs_err / max |reference|`` (normwise over the leaf: robust to elements that cancel
            to ~0); ``0`` when both are zero, ``inf`` when only the reference is.
        tolerance: the allowed ``max_abs_err``: ``atol + rtol * max |reference|`` (``0`` for counters). Where
            an elementwise allowance widens it (a live check's parameters and optimizer state), one element's:
            the one the verdict used (``max_abs_err`` over the largest elementwise ``|c - r| / allowed``), or the
            widest where the first pass cleared the leaf; other elements may be allowed far less
            (``update_seen``).
        ok: ``max_abs_err <= tolerance`` (NaN fails).
        ratio: the median elementwise ratio candidate / reference of the leaf's change in this step (``param``
            and ``opt_state``: after minus before; ``grad`` and ``loss``: the values), over elements where the
            reference change is at least 1% of its largest; ``None`` when undefined (counters, no change); for
            ``state`` the candidate's largest change over the reference's (0: left exactly as it was).
        reference_change: ``param``/``opt_state``/``state``: ``max |reference after - reference before|``, the
            size of the reference's update of this leaf in this step; else ``None``.
        spread: ``(p10, p90)``, the 10th and 90th percentile (order statistics,
            ``shardcheck.parity.comparison.live.spread_ranks``) of the same elementwise ratios whose median is ``ratio``,
            from the same pass; ``None`` where ``ratio`` is, or not computed (a leaf the first pass cleared, a
            hand-built record). A factor is read from ``ratio`` only where they agree with it
            (:func:`constant_ratio`).
        shape: the reference leaf's shape, where known (read by :func:`shared_property` to group leaves).
        samples: a replay's: how many recorded elements (its fixed-index samples) ``ratio`` and ``spread`` were
            read from; ``None`` where they were read over every element (a live check). ``0``: a replay's leaf
            none of whose recorded samples holds a nonzero value or change in the recording (a sparse gradient:
            an embedding's rows the batch did not look up), so ``ratio`` is the whole leaf's (:data:`WHOLE_RATIO`:
            a parameter's largest update, else the L2 norm of its value), ``spread`` ``None``, and no factor
            across the leaf is read from it (:func:`one_factor_across`; trial 16: a norm ratio of 1.593 of a
            gradient whose elements were 0 or 2 x the reference's was said as a constant factor).
        cand_shape: the candidate leaf's shape where it differs from the reference's ``shape`` (an optimizer
            configured otherwise: Adafactor's factored moments against full ones), else ``None``; such a leaf
            fails with ``max_abs_err`` inf, and is said as shaped otherwise, never as not finite.
        missing: the leaf is in one run only (a replay's ``missing`` evidence: a multi_transform whose labels
            differ keeps state for other leaves); it fails with ``max_abs_err`` inf and is said as missing, never
            as not finite.
        kept: ``state`` leaves both steps write: ``(kept, size, where)`` where the candidate's step left ``kept``
            of its ``size`` elements exactly as they were while the reference's changed them and wrote the others
            as the reference did (``where``: ``"rows 4..7 of axis 0"`` for one contiguous block along one axis,
            else ``""``; :func:`shardcheck.parity.comparison.partial_write.partial_write`), else ``None``.
        update_seen: a passing ``param`` leaf whose tolerance is per element (a live check's propagated
            allowance): whether some element's reference update ``|r_t - r_{t-1}|`` exceeds that element's own
            tolerance, so that a wrong update of the leaf (left as it was, or applied twice: off by its whole
            change) fails. ``False``: every element's update is within its tolerance (a wrong update passes).
            ``None``: not measured (a uniform tolerance, where ``reference_change <= tolerance`` says it; a
            replay's digest; a failing step; a step compared against the allowances' lower bound). Read by
            ``weak_update``: ``tolerance`` is then one element's (the widest, or the one nearest failing), and an
            element whose gradient is at rounding level has an allowance of ~2 lr under Adam (trial 19:
            0.00187 at one of 1024 elements, 6.94e-05 at the rest, whose update 0.00094 a doubled update fails).
        zeros: both sides hold only zeros (a gradient of exactly 0: a LoRA factor A while its B is 0, a
            parameter behind a clamp that holds it), which no factor or difference can show; ``False`` where
            either side holds a nonzero element, or where not known.
        counts: a counter's ``(reference's, candidate's)`` integer values after the step (an optimizer's
            ``step``, Adam's ``count``, ``optax.MultiSteps``' ``mini_step`` and ``gradient_step``), else ``None``
            (another kind, or a hand-built record): ``ratio`` alone loses them where they match or the
            reference's is 0.
        cand_zeros: a replay's: the candidate's leaf holds only zeros where the recording's holds a nonzero
            element (an accumulator emptied: ``optax.MultiSteps``' ``acc_grads`` after a step that applied its
            update); ``False`` elsewhere, and in a live record (its forms are fitted from the arrays).
        finite: a ``loss`` or ``grad`` leaf of a skipped step (:attr:`StepRecord.skipped`), compared by finiteness
            alone: ``(reference's, candidate's)``, each whether every element is finite. ``ok`` where they agree
            (both not finite: ``max_abs_err`` 0; one side only: ``max_abs_err`` inf). ``None`` elsewhere (the leaf
            compared by value).
        value_factor: a ``state`` leaf both steps wrote, failing: the one constant k (not 1) that the candidate's
            written value is of the reference's at every element (``c = k r`` within a few float32 ulps, over the
            elements where ``|r|`` is at least 1% of its largest: a psum of a replicated value, x the device
            count), else ``None``.
        dtypes: a counter whose dtype differs between the two sides: ``(reference's, candidate's)`` dtype names,
            e.g. ``("int32", "float32")`` (a step that pmeans or psums the whole optimizer state converts its
            integer counts to floats); such a leaf fails with ``max_abs_err`` inf whatever its value
            (:func:`converted_counter` says it), else ``None``.
        slices: a replay's stacked leaf (ndim >= 2, leading size L >= 2: layers stacked by ``nnx.scan`` /
            ``nnx.vmap``), per slice of its leading axis: ``(n, gap, zero)``, its ``n`` recorded samples, their
            largest ``|candidate - recording|`` (of the change for a parameter or an optimizer-state leaf, else of
            the value) and whether the candidate's are all exactly 0 there; ``None`` elsewhere (a live record's
            forms are fitted from the arrays).
    """

    step: int
    kind: str
    path: str
    max_abs_err: float
    max_rel_err: float
    tolerance: float
    ok: bool
    ratio: float | None = None
    reference_change: float | None = None
    spread: tuple[float, float] | None = None
    shape: tuple[int, ...] | None = None
    samples: int | None = None
    cand_shape: tuple[int, ...] | None = None
    missing: bool = False
    kept: tuple[int, int, str] | None = None
    update_seen: bool | None = None
    zeros: bool = False
    counts: tuple[int, int] | None = None
    cand_zeros: bool = False
    finite: tuple[bool, bool] | None = None
    value_factor: float | None = None
    dtypes: tuple[str, str] | None = None
    slices: tuple[tuple[int, float, bool], ...] | None = None

    @property
    def name(self) -> str:
        """``"<kind> <path>"``, e.g. ``"param hidden.kernel"``; ``"loss"`` for the loss."""
        return self.kind if self.kind == "loss" else f"{self.kind} {self.path}"

    @property
    def reference_within_tolerance(self) -> bool:
        """Whether the reference leaf's largest element is itself within the allowed error, ``max |reference| =
        max_abs_err / max_rel_err <= tolerance`` (``max_rel_err`` inf: the reference is all 0): a leaf at rounding
        level, or one whose elements at rounding level widen its allowance, whose relative error then says
        nothing (trial 50 read a passing row's relative error of 1.08 as alarming). False where nothing differs
        (``max_rel_err`` 0), for exact leaves (tolerance 0) and for a leaf with no difference of its own (in one
        run only, shaped otherwise, a counter of another dtype)."""
        abs_err, rel, tol = self.max_abs_err, self.max_rel_err, self.tolerance
        if self.missing or self.dtypes is not None or not (math.isfinite(abs_err) and math.isfinite(tol)):
            return False
        if tol <= 0 or not rel > 0:
            return False
        return math.isinf(rel) or abs_err / rel <= tol

    @property
    def badness(self) -> float:
        """``max_abs_err / tolerance``: above 1 fails; used to rank leaves."""
        if math.isnan(self.max_abs_err):
            return math.inf
        if self.tolerance > 0:
            return self.max_abs_err / self.tolerance
        return 0.0 if self.max_abs_err == 0 else math.inf


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """Everything compared at one step.

    Attributes:
        step: the 0-based step index t.
        rtol: the relative tolerance used at this step.
        atol: the absolute tolerance used at this step.
        loss: the reference's pre-update loss (float).
        candidate_loss: the candidate's returned loss, or ``None`` when it returned none.
        leaves: one :class:`LeafError` per compared leaf.
        step_count: the reference optimizer's step counter after the step.
        candidate_step_count: the candidate optimizer's update counter after the step (for gradient accumulation:
            the number of applied updates, ``MultiSteps.gradient_step``).
        replica_mismatches: paths of candidate leaves whose replicas hold different bytes on different devices.
        synchronized: the candidate ran this step from a copy of the reference's pre-step state (model and
            optimizer), not from its own trajectory, and was compared at the step-0 tolerance: every step after a
            ``diverged_trajectory`` finding, and the re-check of a step t > 0 that first failed and fails from
            that state too (the step itself is faulty: it is then localized as at step 0).
        matches: the known faulty reductions whose update the candidate's parameters reproduce at this step,
            recomputed by the harness from the reference's pre-step state (``"per_shard_mean"``: each shard's
            ``loss_sum / weight`` averaged over the shards, the mean of per-shard means); checked only when the
            step fails.
        unresolved: ``param`` leaves whose update cannot be resolved from the gradient under this optimizer:
            their reference gradient is at rounding level (a true gradient of 0, such as an attention key bias)
            and a normalizing optimizer (Adam, RMSProp) turns that noise into an update of ~lr. Their tolerance
            includes the update's sensitivity to the gradient's tolerance, propagated through the optimizer;
            their gradients and optimizer state are still compared at the usual tolerance.
        rounding_level: ``param`` leaves whose reference gradient is at rounding level at this step (within its
            tolerance of 0), ``unresolved`` among them (a live check's allowance may still resolve the update of
            the rest): they match under any difference of the gradients, so the grouping does not read their
            matching leaves as contradicting what the failing ones share
            (:func:`~shardcheck.parity.diagnosis.grouping.state_property`'s ``quiet``).
        normalized: the ``unresolved`` leaves whose update the task's optimizer normalizes (Adam's
            ``g / sqrt(v)``: rounding noise becomes an lr-sized update;
            :func:`~shardcheck.parity.tolerance.propagation.normalized_leaves`); ``None``: not known (the
            ``rounding_level`` note then names both cases).
        replica_axes: the mesh axes along which the copies of the leaves of ``replica_mismatches`` differ
            (:func:`shardcheck.parity.diagnosis.topology.mismatch_axes`): the axes a reduction missed.
        global_clip: on a failing step, the ``max_norm`` of the ``optax.clip_by_global_norm`` in the task's
            optimizer (:func:`~shardcheck.parity.diagnosis.hypotheses.clip_norm_of`): its coefficient reads every
            gradient, so one gradient left unreduced scales every leaf's update differently on each device (trial
            44); ``None`` where the optimizer holds none, on a passing step, or not read (a replay).
        scale_hidden: this step cannot show a gradient off by the shard count, one way or both: for the
            gradient times S, or times 1/S, no compared leaf of ``scale_evidence`` would leave its tolerance
            (global-norm clipping that binds rescales it away; an update below its tolerance). ``False`` where
            not checked.
        scale_evidence: ``(leaves that a gradient times S would have failed, leaves that one times 1/S would
            have failed)``, by ``LeafError.name``, from this step's pre-step state: the compared gradients
            (``|c - 1| |g|`` beyond their tolerance) and, where they show nothing, the parameters and optimizer
            state after the reference's optimizer rerun on ``c g``. ``None`` where not checked: the harness asks
            only while the earlier steps have not shown both factors (the verdict needs each shown once).
        scale_blind: some factor showed in no leaf and moved none by more than 1% of its reference change
            times ``|1 - c|``: the optimizer rescales the gradient away (global-norm clipping that binds), rather
            than moving the leaves by less than their tolerance.
        optimizer_rerun: the reference's optimizer rerun on the candidate's own gradients and pre-step state,
            compared with the candidate's state after the step: one ``param`` / ``opt_state`` LeafError per leaf
            (``shardcheck.parity.harness.optimizer_rerun``); ``None`` where not run (a passing step, a candidate
            that returned no gradients, a replay).
        forms: ``((stage, Form), ...)``: the functional form of the difference of a stage's failing leaves, fitted
            on their arrays (``shardcheck.parity.diagnosis.form.fit_form``); ``()`` where none was fitted.
        module: where the step's first difference is the forward pass, the first module whose output differs while its inputs match, at
            equal parameters under the candidate's placement
            (:class:`~shardcheck.parity.diagnosis.module_outputs.ModuleFinding`, from
            ``shardcheck.parity.harness.module_probe``); ``None`` where not probed (any other stage, a replay).
        loss_weight: a failing step of a ``(loss_sum, weight)`` loss: the batch's total weight (the count the loss
            returns, e.g. the unmasked tokens), by which the reference divides the loss sum; a gradient factor
            equal to it is named as a loss sum not divided by its weight. ``None`` otherwise (a mean loss, a
            passing step, a replay's steps after its first failing one).
        forward_writes: a failing step's (live, or a replay's from the recording's ``floating_written``): the model's floating state (``model.<path>``, as its ``state``
            leaves are named) that the task's loss, run alone on the model, writes
            (:func:`~shardcheck.parity.comparison.model_state.loss_access`): a ``state`` leaf the reference's step
            writes and the forward pass does not is written by the step itself (an EMA of the parameters kept
            after the update), so its difference is the step's, not the forward pass's (trial 37). ``None`` where
            not known (an older recording, a loss that cannot be traced): every written leaf counts as the forward
            pass's.
        loss_counters: the model's integer state (``counter model.<path>`` leaves, named as those are) that the
            task's loss, run alone on the model, reads or writes (live: ``model_state.loss_counters``; a replay's:
            the recording's ``counters_touched``): a failing model counter outside it is advanced by the step
            itself (a target network's sync count), not by its forward pass. ``None`` where not known (an older
            recording, a loss that cannot be traced): every model counter counts as the forward pass's.
        per_shard_factor: where the step reproduces the mean of per-shard means (``matches``) and returned
            gradients c times that mean's gradient, c other than 1 (c = S: the per-shard means were summed, a psum
            where a pmean was due); ``None`` otherwise (c = 1, or no gradients returned).
        token_split: where the mean of per-shard means reproduced is that of the rows x tokens blocks a step
            placing the batch over every mesh axis gives (a context-parallel step: ``P('data', 'seq')``), that
            split (:class:`~shardcheck.parity.diagnosis.token_split.TokenSplit`); ``None`` for the row split.
        rerun: a trajectory's failing step after an earlier failure, that step re-run from the reference's
            pre-step state (a :class:`StepRecord`, ``synchronized``): evidence of the step from equal inputs (a
            factor another batch's weight tells apart), never the trajectory's (its leaves are not compared in the
            table, the localization or the verdict; issue #36, trial 46); ``None`` otherwise.
        token_grads: where only the loss value names that split's per-shard means (``per_shard_mean_value``) and
            the step returned gradients, ``(agree, differ)``: the gradient leaves that are, within their
            tolerances, the gradient of the mean of those per-shard means, and those that are not
            (:func:`~shardcheck.parity.diagnosis.token_split.token_grads_agree`); ``None`` otherwise.
        weight_count: a failing step of a ``(loss_sum, weight)`` loss: ``(N, noun)``, the count a step that divides
            by a count in place of the weight would divide by (``"rows"``: the batch's rows, where some rows weigh
            0; ``"entries of batch['mask']"``), from
            :func:`~shardcheck.parity.diagnosis.hypotheses.weight_count`; a gradient factor ``loss_weight / N`` is
            named as that. ``None`` otherwise.
        replayed: a replay's record (read from a recording's digests: ``parity.comparison.digest``), whose steps
            t > 0 were not rerun from the reference's state.
        identical_start: a replay's step t > 0 whose pre-step state (every parameter, optimizer-state, counter
            and model-state leaf after step t - 1) hashed as the recording's (sha256 of equal shape, dtype and
            placement): the step ran from the recorded run's state exactly, as a live re-check runs it, so a
            difference there is the step's own, not divergence grown over earlier steps.
        task_loss: a replay's step run from the recording's state (step 0, or ``identical_start``) whose replayed
            loss is the task's full-batch loss at that state, computed now, within the loss's tolerance, while the
            recorded loss is not: that loss (the recording does not match the task as it is now, or its step
            returned another loss); ``None`` otherwise.
        update_checked: a passing live step whose update check ran and passed (the task's optimizer rerun on its
            own gradients and pre-step state gave its update, within the optimizer's own rounding:
            ``shardcheck.parity.harness.optimizer_rerun.update_check``); ``False`` where it did not run (no
            gradients returned, an optimizer state not the task's by path, a replay's record) or failed.
        skipped: the reference's loss or gradients are not finite at this step while its parameters are exactly as
            they were before it and its optimizer state is finite: a step its optimizer skipped
            (``optax.apply_if_finite``, a loss-scale check), no divergence (a loss that overflows while the
            parameters move is one). Its loss and gradient leaves that are not finite on either side are compared by finiteness
            (``LeafError.finite``); every other leaf as always.
        replica_scales: a failing live step whose returned gradients' copies differ across devices by one constant
            per device, the same on every leaf (:func:`~shardcheck.parity.diagnosis.replica_form.copy_scales`:
            ``(1, a_1, ...)``, device order, device 0's copy the unit): gradients all-reduced, then scaled by a
            quantity of each device's own (a local count or norm); ``None`` otherwise.
        shard_weights: where ``replica_scales`` is set under a ``(loss_sum, weight)`` loss: each of the S batch
            shards' own loss weight (shard order, as the batch axes split it), from which a local divisor's
            constants are predicted (``a_d = w_0 / w_d``); ``None`` otherwise.
        replicas_compared: ``(leaves, devices)``: how many replicated leaves of the candidate's state after the
            step had their copies compared across how many devices (a live check's parameters and optimizer
            state; a replay's recorded ``meta["replicas"]``); ``None`` where none was (one device, no replicated
            leaf, or a recording made before the count was kept).
        micro_means: ``(k, weights, layout, c)`` where the failing step reproduces the step whose gradient is c
            times the mean of the means of k micro-batches of unequal weights (``weights``, each micro-batch's own
            loss weight, in order; ``layout``: ``"blocks"`` of consecutive rows or ``"strided"``, rows i::k, a
            replay's blocks; c: 1, k where they were summed, 1/k where their mean was divided by k again) under
            a ``(loss_sum, weight)`` loss: an accumulation that averaged (or summed) the micro-batches' means where
            their sums over the total weight were meant (``"per_micro_mean"`` in ``matches``); else ``None``.
        batch_keys: where the step's batch is a mapping, its keys other than the model's inputs and the labels
            (``"segment_ids"``, ``"positions"``, ``"weights"``: what a loss reads beside them, a mask, positions
            or weights), in the batch's order; ``()`` otherwise (an array or tuple batch, a replay's record).
        shard_subset: ``(kept, S, division, "shards")`` where the failing step reproduces the reference's
            optimizer step on the gradient of the batch shards ``kept`` only (0-based, in the rows' order; every
            shard alone, or every shard but one), divided as the full batch's (``"full"``: by S, or a weighted
            loss's total weight), by the kept shards' own count or weight (``"own"``), or by the total weight and
            scaled by S over the shards kept (``"share"``): a reduction that left shards out (trial 57: "only
            shard 0's gradient" and "the last shard left out" read "no simple form"); ``(kept, k, division,
            layout)`` the same of k micro-batches of ``layout`` (``"blocks"``, ``"strided"``: an accumulation that
            left micro-batches out, trial 59); else ``None``.
        shard_clip: the max norm M, fitted, where the returned gradients are each shard's own gradient clipped
            to global norm M, then averaged, M not the task's clip norm (``"clip_per_shard"`` in ``matches``;
            :func:`~shardcheck.parity.diagnosis.shard_clip.fitted_shard_clip`, trial 58 C2); else ``None``.
        micro_clip: ``(M, k, layout, of)`` where the returned gradients are the mean over k micro-batches of
            ``layout`` of each one's own gradient (of its loss ``of`` ``"sum"``, ``"mean"`` or ``"either"``)
            clipped to global norm M (``"clip_per_shard"`` in ``matches``;
            :func:`~shardcheck.parity.diagnosis.shard_clip.fitted_micro_clip`, trial 61); else ``None``.
        uses_left_out: ``(module, kept, left_out)`` where the failing gradients are one module's parameters, read
            by several of its calls, and the returned gradients hold the terms of the calls ``kept`` alone, those
            of ``left_out`` missing (a tied embedding's head behind a stop_gradient;
            :func:`~shardcheck.parity.diagnosis.shared_uses.uses_left_out`, trial 61); ``()`` otherwise.
        micro_step_lr: ``((k, c, m, ratio), ...)``: the task's learning-rate schedule at micro-step counts m over
            its value at the count c its step read, for k micro-steps a step, at a failing step
            (:func:`~shardcheck.parity.harness.optimizer_rerun.schedule_at_micro_steps`): an update that is one of
            these ratios x the reference's may come from a schedule counting micro-steps; ``()`` where the task
            holds no one schedule, or unread.
    """

    step: int
    rtol: float
    atol: float
    loss: float
    candidate_loss: float | None
    leaves: tuple[LeafError, ...]
    step_count: int
    candidate_step_count: int
    replica_mismatches: tuple[str, ...] = ()
    synchronized: bool = False
    matches: tuple[str, ...] = ()
    unresolved: tuple[str, ...] = ()
    rounding_level: tuple[str, ...] = ()
    normalized: tuple[str, ...] | None = None
    replica_axes: tuple[str, ...] = ()
    global_clip: float | None = None
    forward_writes: frozenset[str] | None = None
    loss_counters: frozenset[str] | None = None
    scale_hidden: bool = False
    scale_evidence: tuple[tuple[str, ...], tuple[str, ...]] | None = None
    scale_blind: bool = False
    optimizer_rerun: tuple[LeafError, ...] | None = None
    forms: tuple[tuple[str, Any], ...] = ()
    module: Any = None
    loss_weight: float | None = None
    per_shard_factor: float | None = None
    token_split: Any = None
    token_grads: tuple[tuple[str, ...], tuple[str, ...]] | None = None
    rerun: Any = None
    weight_count: tuple[int, str] | None = None
    replayed: bool = False
    identical_start: bool = False
    update_checked: bool = False
    task_loss: float | None = None
    skipped: bool = False
    replica_scales: tuple[float, ...] | None = None
    shard_weights: tuple[float, ...] | None = None
    replicas_compared: tuple[int, int] | None = None
    micro_means: tuple | None = None
    batch_keys: tuple[str, ...] = ()
    shard_subset: tuple[tuple[int, ...], int, str, str] | None = None
    shard_clip: float | None = None
    micro_clip: tuple[float, int, str, str] | None = None
    uses_left_out: tuple = ()
    micro_step_lr: tuple[tuple[int, int, int, float], ...] = ()

    @property
    def update_only(self) -> tuple[LeafError, ...]:
        """The failing leaves of the optimizer rerun where they are the step's only failure (every compared leaf
        within tolerance, the replicas consistent): the update check of a passing step
        (``shardcheck.parity.harness.optimizer_rerun.update_check``); ``()`` otherwise."""
        if self.replica_mismatches or not all(leaf.ok for leaf in self.leaves):
            return ()
        return tuple(e for e in self.optimizer_rerun or () if not e.ok)

    @property
    def ok(self) -> bool:
        """Every leaf within tolerance, every replica consistent, and the optimizer rerun on the candidate's own
        inputs (``optimizer_rerun``, where run) giving its update."""
        rerun = self.optimizer_rerun or ()
        return (
            all(leaf.ok for leaf in self.leaves) and not self.replica_mismatches and all(e.ok for e in rerun)
        )

    @property
    def start_said(self) -> str:
        """How a sentence about this step says where it started (:func:`start_words`), ``""`` for a step that ran
        from the candidate's own state."""
        if self.synchronized:
            return start_words(True)
        return start_words(False) if self.identical_start else ""

    @property
    def from_reference_state(self) -> bool:
        """The step ran from the reference's pre-step state: a live re-check (``synchronized``) or a replay's
        step whose pre-step state was bitwise the recording's (``identical_start``)."""
        return self.synchronized or self.identical_start


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """One finding of the harness.

    Attributes:
        code: a stable identifier, one of the codes table of docs/parity.md (in its order): ``parity``, ``summed``,
            ``averaged_twice``, ``recording_differs``, ``per_shard_loss``, ``unreduced``, ``scaled``,
            ``update_rerun``, ``replicas_differ``, ``step_counter``, ``model_state``, ``frozen_state``,
            ``state_step``, ``target_sync``, ``state_partial``, ``state_amount``, ``never_stepped``, ``loss_only``,
            ``localized``, ``loss_differs``, ``grads_differ``, ``update_differs``, ``forward_differs``,
            ``drift``,
            ``diverged_trajectory``, ``non_finite``, ``reference_diverged``, ``skipped_step``, ``weak_check``,
            ``cannot_verify``, ``normalization``, ``micro_batch_means``, ``weight_count``, ``rounding_level``,
            ``clip_norm``, ``applied_scale``, ``clip_coefficient``, ``clip_per_shard``, ``low_precision_reduction``,
            ``local_clip_norm``, ``wrong_axis_reduction``, ``local_normalization``, ``replicated_reduced``,
            ``expert_scaling``, ``initial_state``, ``structure`` or ``settings_differ``.
        message: the sentence shown to the user.
        leaf: the leaf the finding names, if any (``LeafError.name``).
    """

    code: str
    message: str
    leaf: str | None = None


def start_words(live: bool) -> str:
    """A step that started from the reference's pre-step state, in words: a live re-check ran it from there
    (``" (run from the reference's pre-step state)"``); a replay re-runs nothing from the reference's state, its
    candidate's state before the step was bitwise the recording's (``" (from a pre-step state bitwise the
    recording's)"``)."""
    return (
        " (run from the reference's pre-step state)"
        if live
        else " (from a pre-step state bitwise the recording's)"
    )


def would_show(e: LeafError, factor: float) -> bool:
    """Whether the matching leaf ``e`` would have failed, had its value (a gradient) or its change (a parameter,
    an optimizer-state leaf: ``reference_change``) been ``factor`` x the reference's: ``size |factor - 1| >
    tolerance``, the size ``reference_change`` or ``max |reference| = max_abs_err / max_rel_err``. A leaf whose
    reference is rounding noise (an attention key bias's gradient) matches under any factor and is no evidence
    against one, nor is a leaf of zeros on both sides (``LeafError.zeros``); ``True`` where the size cannot be
    read."""
    size = e.reference_change
    if size is None and e.max_rel_err > 0 and math.isfinite(e.max_rel_err):
        size = e.max_abs_err / e.max_rel_err
    if e.zeros:
        return False  # all zeros on both sides (a LoRA factor A while its B is 0): no factor shows in it
    if size is None or not math.isfinite(size):
        return True
    return size * abs(factor - 1.0) > e.tolerance


def _ratio_tolerance(e: LeafError) -> float:
    """How far one element's ratio ``dc / dr`` may sit from the leaf's factor by rounding alone: the leaf's
    tolerance (scaled by the factor, at least 1) over the smallest change the ratio reads, 1% of the largest
    (``reference_change``, or for values ``max |reference| = max_abs_err / max_rel_err``); ``inf`` where that
    largest is unknown."""
    top = e.reference_change
    if top is None and e.max_rel_err > 0 and math.isfinite(e.max_rel_err):
        top = e.max_abs_err / e.max_rel_err
    if not top or not math.isfinite(top):
        return math.inf
    return e.tolerance * max(1.0, abs(e.ratio or 0.0)) / (0.01 * top)


def constant_ratio(e: LeafError) -> bool:
    """Whether ``e``'s median ratio is one factor across the leaf: its 10th-90th percentile (``e.spread``) lies
    within ``max(RATIO_RTOL |ratio|, SPREAD_TOLS x`` the ratio's rounding tolerance``)`` of the median. ``True``
    where no spread was measured (the median stands, as before it was)."""
    if e.ratio is None or e.spread is None:
        return True
    lo, hi = e.spread
    if not all(math.isfinite(v) for v in (lo, hi, e.ratio)):
        return False
    width = max(RATIO_RTOL * abs(e.ratio), SPREAD_TOLS * _ratio_tolerance(e))
    return abs(lo - e.ratio) <= width and abs(hi - e.ratio) <= width


def one_factor_across(e: LeafError) -> bool:
    """Whether a sentence may call ``e``'s ratio one factor across the leaf: :func:`constant_ratio`, and its 10th-90th
    percentile within ``RATIO_RTOL`` of the median as a fitted array's must be
    (:data:`shardcheck.parity.diagnosis.form.FIT_RTOL`). A rounding-level leaf's wide ratio tolerance keeps it
    "constant" for the rules' purposes, yet its ratio (e.g. 1..6) is no factor to state. Never for a replay's
    leaf whose recorded samples showed no ratio (``samples == 0``: its ratio is the whole leaf's, which a leaf of
    elements 0 or 2 x the reference's has too)."""
    if e.samples == 0 or not constant_ratio(e):
        return False
    return e.spread is None or e.spread[1] - e.spread[0] <= RATIO_RTOL * max(abs(e.ratio), 1e-30)


def spread_phrase(e: LeafError) -> str:
    """``"no constant factor: its elementwise ratio runs from p10 to p90 (10th-90th percentile), median m"``; of a
    replay's leaf whose samples showed no ratio (``samples == 0``), :func:`unsampled_phrase`."""
    if e.spread is None:
        return unsampled_phrase(e)
    lo, hi = e.spread
    return (
        f"no constant factor: its elementwise ratio runs from {lo + 0.0:.4g} to {hi + 0.0:.4g} ({percentiles(e)}), "
        f"median {e.ratio + 0.0:.4g}"
    )


def percentiles(e: LeafError) -> str:
    """``"10th-90th percentile"``, of a replay's ``"10th-90th percentile of its 8 recorded samples"`` (a
    range read from a few elements, not every one as a live check's); of a leaf with one recorded sample, ``"its
    1 recorded sample"`` (one element has no percentile)."""
    if e.samples == 1:
        return "its 1 recorded sample"
    return "10th-90th percentile" + (f" of its {e.samples} recorded samples" if e.samples else "")


WHOLE_RATIO = {"param": "largest update"}
"""What a replay's whole-leaf ratio (``LeafError.samples == 0``) is of, by kind: a parameter's update size
``max|r_t - r_(t-1)|``; any other leaf's the L2 norm of its value (:data:`WHOLE_NORM`)."""
WHOLE_NORM = "L2 norm"


def unsampled_phrase(e: LeafError) -> str:
    """``"no elementwise ratio read: none of its recorded samples holds a nonzero value in the recording; its L2
    norm is 1.593 x the reference's (a whole-leaf ratio: ...)"``: what a replay saw of a leaf whose recorded
    samples hold no usable value or change (``LeafError.samples == 0``)."""
    what = "value" if e.kind in ("grad", "loss") else "change"
    whole = WHOLE_RATIO.get(e.kind, WHOLE_NORM)
    seen = (
        ""
        if e.ratio is None
        else f"; its {whole} is {e.ratio:.4g} x the reference's (a whole-leaf ratio: no factor across the leaf is "
        "read from it)"
    )
    return f"no elementwise ratio read: none of its recorded samples holds a nonzero {what} in the recording{seen}"


# the names a batch's model inputs and labels go by: not what a loss reads beside them
_INPUT_KEYS = frozenset(
    "x y input inputs input_ids tokens ids image images target targets label labels".split()
)


def batch_keys(batch: Any) -> tuple[str, ...]:
    """``StepRecord.batch_keys`` of a batch: a mapping's keys other than its inputs' and labels' usual names
    (``"tokens"``, ``"inputs"``, ``"targets"``, ``"labels"``, ...), in its order; ``()`` for any other batch
    (an array, a tuple)."""
    if not isinstance(batch, Mapping):
        return ()
    return tuple(str(k) for k in batch if str(k).lower() not in _INPUT_KEYS)


def ratio_label(e: LeafError) -> str:
    """What ``e.ratio`` is, said beside its number: ``"update ratio"`` (a parameter's or optimizer-state leaf's
    change), ``"ratio"`` (a value's), or a replay's whole-leaf ratio (``samples == 0``): ``"whole-leaf L2 norm
    ratio"``, ``"whole-leaf largest update ratio"``."""
    if e.samples == 0:
        return f"whole-leaf {WHOLE_RATIO.get(e.kind, WHOLE_NORM)} ratio"
    return "update ratio" if e.kind in ("param", "opt_state") else "ratio"


def converted_counter(e: LeafError, sides: tuple[str, str] = ("the reference", "the candidate")) -> str:
    """The sentence of a counter whose dtype differs between the two sides (``e.dtypes``), ``sides`` naming them
    (the reference's, the candidate's; a replay's: ``("the recording", "this run")``): ``"1.0.count is float32 in the
    candidate, int32 in the reference: the step converted an integer counter (...)"``."""
    ref, cand = e.dtypes or ("?", "?")
    # the side whose counter is not an integer converted it (the recorded run's, where the replay's is the int)
    which = f"{sides[0]}'s step" if _integer(cand) and not _integer(ref) else "the step"
    return (
        f"{e.path} is {cand} in {sides[1]}, {ref} in {sides[0]}: {which} converted an integer counter "
        "(e.g. a pmean/psum of the whole optimizer state: reduce only the float leaves)"
    )


def _integer(dtype: str) -> bool:
    return dtype.startswith(("int", "uint", "bool"))

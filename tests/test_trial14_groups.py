"""A top-2 MoE LM whose router gradients were left unreduced over 'data' (issue #36, trial 14).

Two sentences the records contradicted or did not support. The failing router kernels of both layers
(``blocks.0.moe.router.kernel``, ``blocks.1.moe.router.kernel``) "shared no ndim, name or module": they share
the module ``blocks.*.moe.router``, the same module in every layer, and no matching leaf lies under it; the grouping
now names it (:func:`layer_module`), while a more specific sentence (one layer's module) still wins. In bf16 the
second layer's router gradient, as unreduced as the first, lay within its tolerance, and the replicas' note said
the other leaves differed "only downstream" of the first: a gradient within tolerance may still be unreduced, so
the note now says what the records show, and counts so the numbers add up (the parameters whose gradients differ
hold their values and optimizer state; the rest have gradients within tolerance). Hand-built records of the
trial's 28 parameters.
"""

from __future__ import annotations

import io

from rich.console import Console

from shardcheck.cli.verify import render_report
from shardcheck.parity.diagnosis.evidence import Diagnosis, LeafError, StepRecord
from shardcheck.parity.diagnosis.grouping import NO_PROPERTY, layer_module, shared_property, state_property
from shardcheck.parity.diagnosis.localization import localize
from shardcheck.parity.diagnosis.topology import downstream_note, missed_axes_message, replicas_by_gradient
from shardcheck.parity.report import ParityReport

MESH = {"data": 2, "expert": 2}
ROUTERS = ("blocks.0.moe.router.kernel", "blocks.1.moe.router.kernel")
LAYERED = "every failing leaf is under blocks.*.moe.router (in every layer); every other leaf matches"


def _block(i: int) -> dict[str, tuple[int, ...]]:
    """One layer of the trial's model (D=32, 2 heads of 16, E=4 experts, F=64): 13 parameters."""
    attn = {f"attn.{n}.kernel": (32, 2, 16) for n in ("query", "key", "value")}
    attn |= {f"attn.{n}.bias": (2, 16) for n in ("query", "key", "value")}
    own = {
        "n1.scale": (32,),
        **attn,
        "attn.out.kernel": (2, 16, 32),
        "attn.out.bias": (32,),
        "n2.scale": (32,),
    }
    own |= {"moe.router.kernel": (32, 4), "moe.w_in": (4, 32, 64), "moe.w_out": (4, 64, 32)}
    return {f"blocks.{i}.{k}": v for k, v in own.items()}


PARAMS = {"embed.embedding": (64, 32), **_block(0), **_block(1), "norm.scale": (32,)}


def _split(failing) -> tuple[dict, dict]:
    return {p: PARAMS[p] for p in failing}, {p: s for p, s in PARAMS.items() if p not in failing}


# ------------------------------------------------------------------- one module in every layer of a list


def test_the_routers_of_both_layers_are_grouped_by_their_module_in_every_layer():
    assert len(PARAMS) == 28
    assert shared_property(*_split(ROUTERS)) == LAYERED
    assert layer_module("blocks.1.moe.router.kernel") == "blocks.*.moe.router"
    # an optimizer state's leading indices number its states, not layers: kept
    assert layer_module("1.0.mu.blocks.1.moe.router.kernel") == "1.0.mu.blocks.*.moe.router"
    assert layer_module("embed.embedding") == "embed"


def test_one_layers_router_keeps_the_more_specific_module_and_no_module_is_claimed_where_one_matches():
    # one layer only: its own module, not the layered one
    assert shared_property(*_split(ROUTERS[:1])) == (
        "every failing leaf is under blocks.0.moe.router; every other leaf matches"
    )
    # a third layer whose router matches: the module is not the failing leaves' alone
    failing, matching = _split(ROUTERS)
    matching["blocks.2.moe.router.kernel"] = (32, 4)
    assert NO_PROPERTY in shared_property(failing, matching)
    # a matching leaf under the module in one layer (a router bias): nothing separates them
    matching = {**_split(ROUTERS)[1], "blocks.1.moe.router.bias": (4,)}
    assert NO_PROPERTY in shared_property(failing, matching)
    # failing leaves of two modules (the router and the experts): no one module
    assert NO_PROPERTY in shared_property(*_split((*ROUTERS, "blocks.0.moe.w_in")))
    # a scan's stacked layers share one path: the module prefix says it, as before
    stacked = {"layers.moe.router.kernel": (2, 32, 4)}
    others = {"layers.attn.kernel": (2, 32, 32), "layers.moe.w_in": (2, 4, 32, 64)}
    assert (
        shared_property(stacked, others)
        == "every failing leaf is under layers.moe.router; every other leaf matches"
    )


def test_the_optimizer_state_of_both_routers_is_grouped_by_the_same_module():
    state = {f"1.0.{m}.{p}": s for m in ("mu", "nu") for p, s in PARAMS.items()}
    both = {k: s for k, s in state.items() if k.endswith(ROUTERS)}
    rest = {k: s for k, s in state.items() if k not in both}
    # mu and nu of both routers: read as the parameters they belong to
    assert state_property(both, rest, PARAMS) == LAYERED
    # only the first moments (the trial's f32 run: 2 of 56 optimizer-state leaves): their own paths' module
    mu = {k: s for k, s in both.items() if ".mu." in k}
    assert state_property(mu, {k: s for k, s in state.items() if k not in mu}, PARAMS) == (
        "every failing leaf is under 1.0.mu.blocks.*.moe.router (in every layer); every other leaf matches"
    )


def _grad_record(failing, within=(), mismatches=()) -> StepRecord:
    """Step 0: the loss matches, the gradients of ``failing`` differ, ``within`` are off within tolerance."""
    leaves = [LeafError(0, "loss", "loss", 1e-7, 1e-8, 1e-4, True)]
    for p, shape in PARAMS.items():
        err = 1e-2 if p in failing else (4e-4 if p in within else 1e-7)
        leaves.append(LeafError(0, "grad", p, err, err, 1.5e-3, p not in failing, shape=shape))
    return StepRecord(0, 1e-5, 1e-6, 1.0, 1.0, tuple(leaves), 1, 1, tuple(mismatches), replica_axes=("data",))


def test_the_localization_names_the_layered_module_of_the_failing_gradients():
    text = localize([_grad_record(ROUTERS)]).text()
    assert f"Group: {LAYERED}." in text and NO_PROPERTY not in text


# --------------------------------------------------------------- replicas: gradients within tolerance


def _replicated() -> list[str]:
    """The leaves whose copies differ: every replicated parameter (not the experts', split over 'expert'), its
    value and Adam's two moments: 24 x 3 = 72."""
    params = [p for p in PARAMS if ".w_" not in p]
    return [f"param {p}" for p in params] + [f"opt_state 1.0.{m}.{p}" for m in ("mu", "nu") for p in params]


def test_a_router_gradient_within_the_bf16_tolerance_is_not_said_to_differ_only_downstream():
    names = _replicated()
    # bf16: layer 1's router gradient is off by 4e-4, within its 1.5e-3 tolerance; layer 0's by 1e-2
    record = _grad_record(ROUTERS[:1], within=ROUTERS[1:], mismatches=names)
    note = downstream_note(record)
    assert note == (
        "3 of them are the value and optimizer state of the parameter whose gradient differs; the other 69 have "
        "gradients within tolerance: their copies differ downstream of it or by an unreduced gradient too small "
        "to show at this precision"
    )
    assert 3 + 69 == len(names) == 72
    unreduced, own, rest = replicas_by_gradient(record)
    assert (unreduced, len(own), len(rest)) == (list(ROUTERS[:1]), 3, 69)
    # the leaves of layer 1's router come first among the 69: their gradient is nearest its tolerance
    assert rest[:3] == [f"param {ROUTERS[1]}", *(f"opt_state 1.0.{m}.{ROUTERS[1]}" for m in ("mu", "nu"))]
    message = missed_axes_message(0, own + rest, ("data",), MESH, unreduced=unreduced)
    assert message.startswith(f"After step 0 the copies of param {ROUTERS[0]} differ along mesh axis 'data'")
    assert "only downstream" not in message and "match the reference's" not in message
    assert (
        "The other 69 leaves whose copies differ have gradients within tolerance of the reference's: their copies "
        "differ across 'data' downstream of it, through an update that reads every gradient" in message
    )
    assert (
        "or by an unreduced gradient too small to show at this precision (a gradient within tolerance may still "
        "be unreduced). Reduce every gradient over 'data', not only the one named: where copies still differ once "
        "it is reduced, another was left unreduced too. Not reduced: grad blocks.0.moe.router.kernel; leaves "
        "whose copies differ with their parameter's gradient within tolerance, nearest its tolerance first: the 69 "
        "leaves (param blocks.1.moe.router.kernel, "
        "opt_state 1.0.mu.blocks.1.moe.router.kernel," in message
    )


def test_two_failing_router_gradients_count_their_six_leaves_and_the_rest():
    names = _replicated()
    record = _grad_record(ROUTERS, mismatches=names)
    assert downstream_note(record) == (
        "6 of them are the values and optimizer state of the 2 parameters whose gradients differ; the other 66 "
        "have gradients within tolerance: their copies differ downstream of those or by an unreduced gradient too "
        "small to show at this precision"
    )
    # the replicas row of verify's table and the report's dict say the same
    report = ParityReport("candidate", False, (record,), (Diagnosis("replicas_differ", "replicas_differ"),))
    failure = report.replica_failure
    assert (failure.leaf, failure.leaves, failure.downstream) == (
        f"param {ROUTERS[0]}",
        72,
        downstream_note(record),
    )
    out = io.StringIO()
    Console(file=out, width=2000, color_system=None).print(render_report(report, "setup"))
    row = next(line for line in out.getvalue().splitlines() if line.startswith("│ replicas"))
    assert f"(72 leaves along 'data' differ across devices; {failure.downstream})" in row


def test_no_count_where_no_gradient_or_every_gradient_of_the_differing_leaves_differs():
    names = _replicated()
    # every gradient within tolerance: none is named, nothing is counted
    assert downstream_note(_grad_record((), mismatches=names)) == ""
    # every leaf whose copies differ belongs to a failing gradient: nothing else to count
    own = [n for n in names if n.endswith(ROUTERS)]
    assert downstream_note(_grad_record(ROUTERS, mismatches=own)) == ""

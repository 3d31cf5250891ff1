"""Does every FAIL name its stage, group and form? An audit of every fault shardcheck ships or plants (issue #36).

Each fault below is checked live (``check_parity(step, task, ...)``, against the task's single-device step) and,
where its right step can be recorded, replayed (``check_parity(step, task, reference=record_run(task, right))``,
what ``verify --against FILE`` runs), on one step (the first batch: every fault here fails at step 0). For each
FAIL the audit reads the report's :class:`~shardcheck.parity.diagnosis.localization.Localization`:

- ``stage``: the first stage that differs, or ``None`` (no stage shows the failure);
- ``group``: the sentence naming what the failing leaves share, or empty (counted apart: a sentence that says
  no property separates them, "share no ndim, name or module that the matching ones lack");
- ``form``: the form's kind, ``None`` where none was fitted; a ``none`` form ("no simple form") counts as a form
  when its sentence names the widest spread (``runs from``);
- ``false``: the claims of the diagnosis text (the localization and every finding) that
  :func:`~shardcheck.parity.diagnosis.localization.contradiction` flags against the records.

The faults, cheapest settings (one step, the tests' own tiny tasks):

- ``tests/test_replay_diagnosis.py`` (a user's dp AdamW step on 2 devices): a sum for a mean, a doubled learning
  rate, a weight decay of the 1-D leaves; ``tests/test_localization.py``: a gradient scaled on part of one leaf;
- ``tests/test_clipping_faults.py``: a local clip norm, a clip by the mean of per-device norms, a norm counted once
  per replica, the task's clip run inside ``shard_map`` (on 2 devices);
- ``tests/test_verdict.py``: an optimizer stepped per micro-batch (``apply_every``), a summed micro-gradient under
  accumulation; ``tests/test_accumulation.py``: a summing ``MultiSteps`` accumulator;
- ``examples/zoo/*.py``: every ``FAULTS`` entry, on the file's ``MESH``;
- ``benchmarks/bug_reports.py``: the 8 public bug reports' faulty steps (``data=4``);
- ``tests/test_stage_localization.py``: the planted faults (decay mask, Adam epsilon of one module, one module's
  gradients scaled, a schedule one step ahead, a gradient left unreduced, the same returning no gradients).

Run it with::

    python benchmarks/fail_audit.py                      # every fault: the table, the counts, fail_audit.json
    python benchmarks/fail_audit.py --sources zoo bug_reports --no-replay --out a.json

It creates 8 fake CPU devices before JAX starts (the test suite's configuration, ``tests/conftest.py``); about
3.5 to 7 minutes on a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]
import conftest  # noqa: E402  (8 fake CPU devices and the suite's compile flags, before JAX starts)

from shardcheck import check_parity, make_mesh  # noqa: E402
from shardcheck.parity.diagnosis.localization import contradiction  # noqa: E402
from shardcheck.parity.harness.recorded import record_run  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Fault:
    """One planted fault.

    Attributes:
        source: where it is planted (``tests/test_x.py``, ``examples/zoo/moe.py``, ``benchmarks/bug_reports.py``).
        name: its name there.
        build: ``() -> (candidate, task, kwargs, right)``: the faulty step, the task, the ``check_parity``
            keyword arguments (``num_shards``, ``mesh``) and the right step to record (``None``: no replay).
    """

    source: str
    name: str
    build: Callable[[], tuple]


def _replay_faults() -> list[Fault]:
    import test_localization as tl
    import test_replay_diagnosis as tr

    def dp(fault, module=tr):
        def build():
            step = tr._step(fault) if module is tr else tl._dp_step(fault)
            return step, tl._task(), {"mesh": make_mesh(2)}, tr._step("none")

        return build

    out = [Fault("tests/test_replay_diagnosis.py", f, dp(f)) for f in ("summed", "lr2", "decay_1d")]
    return [*out, Fault("tests/test_localization.py", "part", dp("part", tl))]


def _clipping_faults() -> list[Fault]:
    import test_clipping_faults as tc

    def clip(norm):
        def build():
            step = tc._clip_inside_shard_map_step if norm == "inside" else tc._clipping_step(norm, {})
            return step, tc._task(), {"mesh": make_mesh(2)}, tc._clipping_step("global", {})

        return build

    src = "tests/test_clipping_faults.py"
    return [Fault(src, f"clip_{n}", clip(n)) for n in ("local", "mean", "replica", "inside")]


def _accumulation_faults() -> list[Fault]:
    import dataclasses as dc

    import optax
    import test_accumulation as ta
    import test_verdict as tv
    from flax import nnx

    from shardcheck.steps.accumulation import accumulation_candidate

    def per_micro_batch():
        task = tv.adam_lm()
        return tv.apply_every_candidate(task.loss_fn, 2, False), task, {"num_shards": 2}, "accumulation"

    def summed_micro():
        task = tv.clipped_lm()

        def summed_loss(model, batch):
            total, weight = tv.lm_loss(model, batch)
            return 2 * total, weight

        cand = dc.replace(accumulation_candidate(summed_loss, 2), name="summed")
        return cand, task, {"num_shards": 2}, "accumulation"

    def summing_multisteps():
        from shardcheck import make_model
        from shardcheck.losses import mse_batch_loss
        from shardcheck.task import Task

        def make_summing(model, optimizer):
            return nnx.Optimizer(model, optax.MultiSteps(optimizer.tx, 4, use_grad_mean=False), wrt=nnx.Param)

        cand = dc.replace(accumulation_candidate(mse_batch_loss, 4), make_optimizer=make_summing)
        task = Task(
            model=lambda: make_model("linear", 3, 2, seed=2),
            optimizer=ta.TX["momentum"],
            loss_fn=mse_batch_loss,
            batches=list(ta.BATCHES[:2]),
        )
        return cand, task, {"num_shards": 4}, "accumulation"

    return [
        Fault("tests/test_verdict.py", "optimizer_per_micro_batch", per_micro_batch),
        Fault("tests/test_verdict.py", "summed_micro_gradient", summed_micro),
        Fault("tests/test_accumulation.py", "summing_accumulator", summing_multisteps),
    ]


def _zoo_faults() -> list[Fault]:
    out = []
    for path in sorted((ROOT / "examples" / "zoo").glob("*.py")):
        if path.name.startswith("_"):
            continue
        module = conftest.zoo_module(path)
        for fault, (faulty, _code) in module.FAULTS.items():

            def build(module=module, faulty=faulty):
                return faulty, module.task, {"mesh": make_mesh(module.MESH)}, module.step

            out.append(Fault(f"examples/zoo/{path.name}", fault, build))
    return out


def _bug_report_faults() -> list[Fault]:
    import bug_reports as br

    def build(case):
        return lambda: (case.faulty, case.task(), {"mesh": make_mesh(br.DEVICES)}, case.correct)

    return [Fault("benchmarks/bug_reports.py", c.name, build(c)) for c in br.CASES]


def _stage_faults() -> list[Fault]:
    import test_stage_localization as ts

    from shardcheck.parity.harness.candidates import as_candidate

    def decay_mask():
        cand = ts._with_tx(as_candidate("t", "dp", ts._task(), 2, None, None), ts._adamw(keep_scale=False))
        return cand, ts._task(), {"num_shards": 2}, "dp"

    def adam_eps():
        cand = ts._with_tx(
            as_candidate("t", "fsdp", ts._task(), 2, None, None), ts._eps_for("blocks.0.fc1", 1e-3)
        )
        return cand, ts._task(), {"num_shards": 2}, "fsdp"

    def scaled_module():
        task = ts._task(tensor_parallel=(("model", 2),))
        mesh = make_mesh({"data": 2, "model": 2})
        faulty = dataclasses.replace(task, loss_fn=ts._scaled_grads(task.loss_fn, "blocks.0.fc2", 3.0))
        cand = as_candidate("t", "dp", faulty, 2, mesh, None)
        return cand, task, {"mesh": mesh}, as_candidate("t", "dp", task, 2, mesh, None)

    def schedule_ahead():
        import optax

        task = ts._task(schedule=True)
        ahead = optax.adam(lambda count: optax.exponential_decay(ts.LR, 1, 0.5)(count + 1))
        cand = ts._with_tx(as_candidate("t", "accumulation", task, 4, None, None), ahead)
        return cand, task, {"num_shards": 4}, "accumulation"

    def unreduced(returns_grads=True):
        def build():
            task = ts._task()
            mesh = make_mesh({"data": 2})
            kw = {} if returns_grads else {"returns_grads": False}
            try:
                cand = ts._unreduced_step(task.loss_fn, mesh, "blocks.0.fc1", **kw)
            except TypeError:  # a checkout whose planted step always returns its gradients
                return None
            return cand, task, {"num_shards": 2}, "dp"

        return build

    src = "tests/test_stage_localization.py"
    return [
        Fault(src, "decay_mask_norm_scale", decay_mask),
        Fault(src, "adam_eps_one_module", adam_eps),
        Fault(src, "one_module_grads_x3", scaled_module),
        Fault(src, "schedule_one_step_ahead", schedule_ahead),
        Fault(src, "unreduced_one_module", unreduced()),
        Fault(src, "unreduced_no_grads", unreduced(False)),
    ]


# the grouping's sentence where no property separates the failing leaves from the matching ones
NO_PROPERTY = "share no ndim, name or module that the matching ones lack"

SOURCES = {
    "replay": _replay_faults,
    "clipping": _clipping_faults,
    "accumulation": _accumulation_faults,
    "zoo": _zoo_faults,
    "bug_reports": _bug_report_faults,
    "stage": _stage_faults,
}


def audit_report(report) -> dict:
    """The audit of one report: its verdict, and for a FAIL the localization's stage, group, form and the
    contradicted claims of its text."""
    row = {"verdict": report.verdict, "codes": list(report.codes)}
    if report.ok:
        return row
    loc = report.localization
    form = None if loc is None else loc.form
    texts = [report.diagnosis, *(d.message for d in report.diagnoses)]
    flagged = sorted({c for t in texts if (c := contradiction(t, report.steps)) is not None})
    row.update(
        stage=None if loc is None else loc.stage,
        group="" if loc is None else loc.group,
        form=None if form is None else form.kind,
        form_sentence="" if form is None else form.sentence,
        form_ok=form is not None and (form.kind != "none" or "runs from" in form.sentence),
        false=flagged,
        localization="" if loc is None else loc.text(),
    )
    return row


def run_fault(fault: Fault, replay: bool) -> list[dict]:
    """The fault checked live and (``replay``, where it has a right step) replayed, on one step."""
    rows = []
    base = {"source": fault.source, "fault": fault.name}
    try:
        built = fault.build()
    except Exception as err:  # noqa: BLE001  (an audit row, not a crash: the fault could not be built)
        return [{**base, "mode": "live", "verdict": "ERROR", "error": f"{type(err).__name__}: {err}"}]
    if built is None:
        return []
    cand, task, kw, right = built
    modes = [("live", None)]
    if replay and right is not None:
        modes.append(("replay", right))
    for mode, ref in modes:
        start = time.perf_counter()
        try:
            if ref is None:
                report = check_parity(cand, task, steps=1, **kw)
            else:
                report = check_parity(cand, task, reference=record_run(task, ref, steps=1, **kw), **kw)
            row = audit_report(report)
        except Exception as err:  # noqa: BLE001
            row = {
                "verdict": "ERROR",
                "error": f"{type(err).__name__}: {err}",
                "trace": traceback.format_exc(),
            }
        rows.append({**base, "mode": mode, **row, "seconds": round(time.perf_counter() - start, 1)})
        print(_line(rows[-1]), flush=True)
    return rows


def _line(r: dict) -> str:
    if r["verdict"] != "FAIL":
        return f"{r['source']} {r['fault']} {r['mode']}: {r['verdict']} {r.get('error', '')}"
    return (
        f"{r['source']} {r['fault']} {r['mode']}: stage={r['stage']} group={bool(r['group'])} form={r['form']}"
        f" false={r['false']} ({r['seconds']} s)"
    )


def counts(rows: list[dict]) -> dict:
    """How many FAILs name a stage, a group, a form (a ``none`` form naming its spread counts), and say nothing
    false; the other verdicts."""
    fails = [r for r in rows if r["verdict"] == "FAIL"]
    return {
        "fails": len(fails),
        "stage": sum(r["stage"] is not None for r in fails),
        "group": sum(bool(r["group"]) for r in fails),
        "group_names_a_property": sum(bool(r["group"]) and NO_PROPERTY not in r["group"] for r in fails),
        "form": sum(r["form_ok"] for r in fails),
        "form_kinds": {
            k: sum(r["form"] == k for r in fails) for k in sorted({str(r["form"]) for r in fails})
        },
        "nothing_false": sum(not r["false"] for r in fails),
        "other_verdicts": {
            v: sum(r["verdict"] == v for r in rows) for v in {r["verdict"] for r in rows} - {"FAIL"}
        },
        **replay_as_live(rows),
    }


def replay_as_live(rows: list[dict]) -> dict:
    """How many replayed faults FAIL at the live check's stage (a live ``replicas`` stage, which a replay cannot
    observe, is matched by any later one), and the faults that do not (``"source fault: live X, replayed Y"``)."""
    live = {(r["source"], r["fault"]): r for r in rows if r["mode"] == "live"}
    pairs, differ = 0, []
    for r in rows:
        ref = live.get((r["source"], r["fault"]))
        if r["mode"] != "replay" or ref is None or ref["verdict"] != "FAIL":
            continue
        pairs += 1
        same = r["verdict"] == "FAIL" and (r["stage"] == ref["stage"] or ref["stage"] == "replicas")
        if not same:
            got = r["stage"] if r["verdict"] == "FAIL" else r["verdict"]
            differ.append(f"{r['source']} {r['fault']}: live {ref['stage']}, replayed {got}")
    return {"replayed": pairs, "replay_at_live_stage": pairs - len(differ), "replay_differs": differ}


def print_table(rows: list[dict]) -> None:
    """The rows as a rich table, then the counts."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Every FAIL: stage, group, form")
    for col in ("source", "fault", "mode", "verdict", "stage", "group", "form", "false"):
        table.add_column(col, overflow="fold")
    for r in rows:
        fail = r["verdict"] == "FAIL"
        group = (r["group"][:60] + ("..." if len(r["group"]) > 60 else "")) if fail else ""
        table.add_row(
            r["source"].split("/")[-1],
            r["fault"],
            r["mode"],
            r["verdict"],
            str(r.get("stage")) if fail else "",
            group or ("-" if fail else ""),
            (str(r["form"]) + ("" if r["form_ok"] else " (!)")) if fail else "",
            ", ".join(r["false"]) if fail else "",
        )
    console = Console(width=200)
    console.print(table)
    console.print(counts(rows))


def main(argv: list[str] | None = None) -> int:
    """Run the faults of ``--sources`` (default: all), print the table and counts, write ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sources", nargs="*", choices=sorted(SOURCES), help="default: all")
    parser.add_argument("--faults", nargs="*", help="only these fault names")
    parser.add_argument("--no-replay", action="store_true", help="live checks only")
    parser.add_argument("--out", default=str(Path(__file__).with_name("fail_audit.json")))
    parser.add_argument("--label", default="", help="what was measured (e.g. a commit), stored in the JSON")
    args = parser.parse_args(argv)
    faults = [f for s in args.sources or SOURCES for f in SOURCES[s]()]
    if args.faults:
        faults = [f for f in faults if f.name in args.faults]
    rows = [row for f in faults for row in run_fault(f, not args.no_replay)]
    print_table(rows)
    result = {"counts": counts(rows), "rows": rows, "measured": args.label}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`refill runs | run show | steps | slots | slot | budget | workers | tail`: read the ledger.

Every command takes `--database-url` (default REFILL_DATABASE_URL, else the embedded ledger),
prints a rich table for people or, with `--json`, JSON for scripts, and reads one consistent
snapshot of the ledger (`refill.models.queries.read_snapshot`). An unknown run, step or slot is
one `error:` line and exit 2. The questions themselves live in `refill.models.queries`.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

from refill.admin.console import (
    EXIT_BAD_INPUT,
    EXIT_INVALID,
    err_console,
    fail,
    note,
    out_console,
    print_json,
    print_yaml,
    warn,
)

T = TypeVar("T")

DatabaseUrl = Annotated[
    str | None,
    typer.Option(
        "--database-url",
        help="Ledger URL (default: REFILL_DATABASE_URL, else sqlite:///runs/refill.db).",
        show_default=False,
    ),
]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of a table.")]
RunId = Annotated[int, typer.Argument(metavar="RUN", help="Run id (see `refill runs`).", show_default=False)]


class RunStatusChoice(enum.StrEnum):
    created = "created"
    running = "running"
    completed = "completed"
    failed = "failed"
    stopped = "stopped"


class StepStatusChoice(enum.StrEnum):
    open = "open"
    released = "released"
    training = "training"
    trained = "trained"


class SlotStatusChoice(enum.StrEnum):
    open = "open"
    committed = "committed"
    shrunk = "shrunk"


# --- shared helpers -------------------------------------------------------------------------


@contextmanager
def ledger_for(database_url: str | None) -> Iterator[Any]:
    """The ledger of `--database-url` (a one-line error and exit 2 when there is none),
    disposed of afterwards so that a long-lived caller leaks no connections."""
    from refill.admin.ledger_access import open_ledger

    ledger = open_ledger(database_url)
    try:
        yield ledger
    finally:
        ledger.dispose()


def read(database_url: str | None, question: Callable[[Any], T]) -> T:
    """Answer `question(session)` on one snapshot; NotFound becomes `error: ...`, exit 2."""
    from refill.admin.snapshot import read_snapshot

    with ledger_for(database_url) as ledger, read_snapshot(ledger) as session:
        try:
            return question(session)
        except LookupError as error:
            fail(str(error.args[0] if error.args else error), EXIT_BAD_INPUT)


def show(renderable: RenderableType) -> None:
    """Print a table on stdout: at the terminal's width for people, at its natural width when
    stdout is a pipe or a file (rich would otherwise cut every cell to fit 80 columns)."""
    if out_console.is_terminal:
        out_console.print(renderable)
    else:
        Console(soft_wrap=True, highlight=False, width=4096).print(renderable)


def print_table(rows: list[Any], columns: list[str] | None = None, *, title: str | None = None) -> None:
    """Rows (mappings, or sequences with `columns`) as a table; None prints as an empty cell,
    numeric columns are right-aligned (as `refill.admin.console.print_table`)."""
    if columns is None:
        columns = list(rows[0].keys()) if rows else []
    cells = [[row.get(c) for c in columns] if isinstance(row, dict) else list(row) for row in rows]
    table = Table(title=title)
    for i, column in enumerate(columns):
        values = [r[i] for r in cells if r[i] is not None]
        numeric = bool(values) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
        table.add_column(column, justify="right" if numeric else "left")
    for row in cells:
        table.add_row(*(Text("" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)) for v in row))
    show(table)


def jsonable(value: Any) -> Any:
    """Datetimes as ISO 8601 (UTC), containers recursively; everything else as it is."""
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat()
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def when(value: datetime | None) -> str | None:
    """A timestamp for a table cell: UTC, to the second."""
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if value is not None else None


def clock(value: datetime | None) -> str | None:
    return value.astimezone(UTC).strftime("%H:%M:%S") if value is not None else None


def ago(value: datetime | None, now: datetime) -> str | None:
    if value is None:
        return None
    seconds = (now - value).total_seconds()
    if seconds < 0:
        return f"in {-seconds:.0f}s"
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


def num(value: float | None, digits: int = 3) -> str | None:
    return None if value is None else f"{value:.{digits}f}"


def first_line(text: str | None, width: int = 60) -> str | None:
    if not text:
        return None
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= width else line[: width - 1] + "…"


# --- refill runs ----------------------------------------------------------------------------


def runs(
    database_url: DatabaseUrl = None,
    status: Annotated[RunStatusChoice | None, typer.Option(help="Only runs in this state.")] = None,
    limit: Annotated[int | None, typer.Option(help="At most this many, newest first.", min=1)] = None,
    as_json: AsJson = False,
) -> None:
    """List the runs in the ledger, newest first.

    With each: its state, how many steps it trained, its weight version and batch shape."""
    from refill.admin.run_queries import list_runs

    rows = read(database_url, lambda s: list_runs(s, status=status.value if status else None, limit=limit))
    if as_json:
        print_json(jsonable(rows))
        return
    if not rows:
        note("no runs in this ledger")
        return
    print_table(
        [
            {
                "run": r["run_id"],
                "name": r["name"],
                "status": r["status"],
                "end": r["end_reason"],
                "steps": f"{r['trained_steps']}/{r['max_num_steps']}",
                "version": r["weight_version"],
                "batch": f"{r['num_prompts_per_step']}x{r['group_size']}",
                "created (UTC)": when(r["created_at"]),
                "seconds": None if r["seconds"] is None else round(r["seconds"], 1),
            }
            for r in rows
        ]
    )


# --- refill run show ------------------------------------------------------------------------


def run_show(
    run_id: RunId,
    database_url: DatabaseUrl = None,
    config: Annotated[bool, typer.Option("--config", help="Also print the run's config snapshot.")] = False,
    as_json: AsJson = False,
) -> None:
    """Show one run: state, knobs, position and counts.

    Counts of its steps, slots, attempts (by state and reason), groups and refused results,
    and the measured zero-variance fraction."""
    from refill.admin.run_queries import run_detail
    from refill.admin.snapshot import get_run

    def question(session: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
        detail = run_detail(session, run_id)
        return detail, (dict(get_run(session, run_id).config) if config else None)

    detail, snapshot = read(database_url, question)
    if snapshot is not None:
        snapshot = _redacted_config(snapshot)
    if as_json:
        print_json(jsonable({**detail, **({"config": snapshot} if snapshot is not None else {})}))
        return
    d = detail
    fields: list[tuple[str, Any]] = [
        ("run", f"{d['run_id']} ({d['name']})"),
        ("status", d["status"] + (f" ({d['end_reason']})" if d["end_reason"] else "")),
        ("run dir", d["run_dir"]),
        ("created / started / finished (UTC)", " / ".join(when(d[k]) or "-" for k in ("created_at", "started_at", "finished_at"))),
        ("controller", f"{d['controller_id'] or '-'} (seen {when(d['controller_seen_at']) or '-'})"),
        ("steps trained", f"{d['trained_steps']} of {d['max_num_steps']}; weights v{d['weight_version']}; next step {d['next_step']}"),
        ("batch", f"{d['num_prompts_per_step']} prompts x {d['group_size']} generations; max_lookahead_versions {d['max_lookahead_versions']}"),
        ("generation / trainer", f"{d['backend']} / {d['trainer']}"),
        ("dynamic sampling", f"{'on' if d['use_dynamic_sampling'] else 'off'}, budget {d['filter_budget']} per slot, tolerance {d['zero_variance_tolerance']}"),
        ("sampler", f"{d['sampler']}; over-dispatch {'on' if d['over_dispatch'] else 'off'}"),
        ("dropped prompts", f"{d['on_dropped_prompt']} (drop budget {d['drop_budget']}); {d['max_attempts_per_prompt']} tries per prompt; min step fraction {d['min_step_batch_fraction']}"),
        ("data", f"{d['num_prompts']} prompts; epoch {d['loader_epoch']} at {d['loader_cursor']}{' (exhausted)' if d['loader_exhausted'] else ''}; spare pool {d['spare_pool']}"),
        ("steps", _counts(d["steps"])),
        ("slots", _counts(d["slots"])),
        ("attempts", _counts(d["attempts"])),
        ("attempt reasons", _counts(d["attempt_reasons"])),
        ("groups", _counts(d["groups"])),
        ("rejected results", _counts(d["rejected_results"])),
        ("zero-variance fraction", f"{num(d['zero_variance_fraction'])} ({d['zero_variance_groups']} of {d['finished_groups']} finished groups)"),
        ("mean reward", f"first steps {num(d['mean_reward_first_steps'])}, last steps {num(d['mean_reward_last_steps'])}"),
        ("config hash / data", f"{d['config_hash'][:12]} / {d['data_fingerprint'][:12]}"),
    ]
    if d["database_url"] or d["broker_url"]:
        fields.append(("ledger / broker", f"{d['database_url'] or '-'} / {d['broker_url'] or '-'}"))
    if d["consecutive_dropped"] or d["stop_requested"]:
        fields.append(("consecutive drops / stop requested", f"{d['consecutive_dropped']} / {d['stop_requested']}"))
    print_table(fields, ["field", "value"], title=f"run {d['run_id']}")
    if d["error"]:
        err_console.print(d["error"], markup=False)
    if snapshot is not None:
        print_yaml(snapshot)


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "-"


def _redacted_config(config: dict[str, Any]) -> dict[str, Any]:
    from refill.config import redact_url

    infra = dict(config.get("infra") or {})
    for key in ("database_url", "broker_url"):
        if infra.get(key):
            infra[key] = redact_url(infra[key])
    return {**config, "infra": infra} if "infra" in config else config


# --- refill steps ---------------------------------------------------------------------------


def steps(
    run_id: RunId,
    database_url: DatabaseUrl = None,
    status: Annotated[StepStatusChoice | None, typer.Option(help="Only steps in this state.")] = None,
    as_json: AsJson = False,
) -> None:
    """Show the run's steps: how full, what their attempts did, reward, timings."""
    from refill.admin.run_queries import step_rows

    rows = read(database_url, lambda s: step_rows(s, run_id, status=status.value if status else None))
    if as_json:
        print_json(jsonable(rows))
        return
    if not rows:
        note(f"run {run_id} has no steps" + (f" in state {status.value}" if status else ""))
        return
    print_table(
        [
            {
                "step": r["step"],
                "status": r["status"],
                "full": f"{r['committed']}/{r['target']}",
                "shrunk": r["shrunk"],
                "open": r["open_slots"],
                "attempts": r["attempts"],
                "live": r["live_attempts"],
                "filtered": r["filtered_attempts"],
                "failed": r["failed_attempts"],
                "borrowed": r["borrowed_in"],
                "reward": num(r["reward"]),
                "1st-try": num(r["first_attempt_reward"]),
                "zero-var": num(r["zero_variance_fraction"], 2),
                "fill s": num(r["step_fill_seconds"], 2),
                "idle s": num(r["trainer_idle_seconds"], 2),
                "released": clock(r["released_at"]),
            }
            for r in rows
        ],
        title=f"run {run_id}: steps",
    )


# --- refill slots ---------------------------------------------------------------------------


def slots(
    run_id: RunId,
    step: Annotated[int | None, typer.Option("--step", help="The step (default: every step not yet trained).")] = None,
    status: Annotated[SlotStatusChoice | None, typer.Option(help="Only slots in this state.")] = None,
    database_url: DatabaseUrl = None,
    as_json: AsJson = False,
) -> None:
    """Show a step's slots: state, group, live attempt, budgets, failures.

    `--status open` lists the slots a step is waiting on; without --step, the slots of every
    step not yet trained."""
    from refill.admin.slot_queries import slot_rows

    rows = read(
        database_url, lambda s: slot_rows(s, run_id, step=step, status=status.value if status else None)
    )
    if as_json:
        print_json(jsonable(rows))
        return
    if not rows:
        where = f"step {step}" if step is not None else "the steps not yet trained"
        note(f"run {run_id}: no {status.value + ' ' if status else ''}slots in {where}")
        return
    now = datetime.now(UTC)
    print_table(
        [
            {
                "step": r["step"],
                "slot": r["slot"],
                "status": r["status"] + (f" ({r['shrink_reason']})" if r["shrink_reason"] else ""),
                "group": r["group_attempt_id"],
                "ver": r["group_weight_version"],
                "stale": r["staleness"],
                "live attempt": (
                    f"{r['live_attempt_id']} {r['live_state']}"
                    + (f" on {r['live_worker']}" if r["live_worker"] else "")
                    + (f" (+{r['live_attempts'] - 1})" if r["live_attempts"] > 1 else "")
                    if r["live_attempt_id"] is not None
                    else None
                ),
                "since": ago(r["live_started_at"], now) if r["live_attempt_id"] is not None else None,
                "tries": r["attempts"],
                "filtered": r["filtered"],
                "filter budget": f"{r['filter_replacements']}/{r['filter_budget']}",
                "infra": r["infra_failures"],
                "data": r["data_failures"],
                "drop budget": f"{r['drop_replacements']}/{r['drop_budget']}",
                "borrowed": r["borrowed_in"],
                "lent": r["lent_out"],
            }
            for r in rows
        ],
        title=f"run {run_id}: slots" + (f" of step {step}" if step is not None else ""),
    )


# --- refill slot ----------------------------------------------------------------------------


def slot(
    run_id: RunId,
    step: Annotated[int, typer.Argument(metavar="STEP", show_default=False)],
    index: Annotated[int, typer.Argument(metavar="SLOT", show_default=False)],
    database_url: DatabaseUrl = None,
    as_json: AsJson = False,
) -> None:
    """Show every attempt of one slot, and where its group came from.

    With each attempt: prompt, worker, weight version, rewards, outcome, latency and error;
    attempts handed to or from the slot are included, and a borrowed group names its lender."""
    from refill.admin.slot_queries import slot_history

    h = read(database_url, lambda s: slot_history(s, run_id, step, index))
    if as_json:
        print_json(jsonable(h))
        return
    head = f"run {run_id}, step {step}, slot {index}: {h['status']}"
    if h["shrink_reason"]:
        head += f" ({h['shrink_reason']})"
    if h["group_attempt_id"] is not None:
        head += f", holds the group of attempt {h['group_attempt_id']} (weights v{h['group_weight_version']})"
    elif h["needs_replacement"]:
        head += ", waiting on a replacement"
    out_console.print(head, markup=False)
    if h["group_source"]:
        out_console.print(f"its group was borrowed from {h['group_source']}", markup=False)
    out_console.print(f"prompt {h['prompt_id']}: {first_line(h['prompt'], 100)}", markup=False)
    out_console.print(
        f"filter budget {h['filter_replacements']}/{h['filter_budget']} ({h['filtered']} filtered); "
        f"drop budget {h['drop_replacements']}/{h['drop_budget']} ({h['drops']} dropped, "
        f"{h['infra_failures']} infra and {h['data_failures']} data failures); "
        f"borrowed in {h['borrowed_in']}, lent out {h['lent_out']}",
        markup=False,
    )
    rows = []
    for a in h["attempts"]:
        rewards = a["rewards"]
        rows.append(
            {
                "attempt": a["attempt_id"],
                "relation": a["relation"] + (f" {tuple(a['aimed'])}" if a["relation"] in ("reaimed_out", "borrowed_in") else "")
                + (f" from {tuple(a['origin'])}" if a["relation"] == "reaimed_in" else ""),
                "reason": a["reason"] + (f" #{a['try_no']}" if a["try_no"] > 1 else ""),
                "prompt": f"{a['prompt_id']}: {first_line(a['prompt'], 24)}",
                "worker": a["worker"],
                "ver": a["weight_version"],
                "rewards": (
                    f"{a['reward_mean']:.3f} [{' '.join(f'{r:g}' for r in rewards[:8])}{' …' if len(rewards) > 8 else ''}]"
                    if rewards
                    else None
                ),
                "outcome": a["outcome"] + (f", {a['rejected_results']} results refused" if a["rejected_results"] else ""),
                "gen s": num(a["generation_seconds"], 2),
                "wall s": num(a["latency_seconds"], 2),
                "error": first_line(a["error"], 50),
            }
        )
    if rows:
        print_table(rows, title="attempts")
    else:
        note("no attempt has touched this slot yet")


# --- refill budget --------------------------------------------------------------------------


def budget(
    run_id: RunId,
    database_url: DatabaseUrl = None,
    step: Annotated[int | None, typer.Option("--step", help="Only this step's slots.")] = None,
    every_slot: Annotated[bool, typer.Option("--all", help="List every slot, not only those that used a budget.")] = False,
    as_json: AsJson = False,
) -> None:
    """Show budget use per slot, the zero-variance fraction p and the exhaustion risk.

    The dynamic-sampling (filter) and fault-tolerance (drop) budgets of each slot, used and
    left; budget_exhaustion_risk is the probability that some slot of the run exhausts its
    filter budget, 1 - (1 - p**(budget+1))**(N * max_num_steps); the expected number of
    exhausted slots is p**(budget+1) * N * max_num_steps."""
    from refill.admin.budget_queries import budget_report

    b = read(database_url, lambda s: budget_report(s, run_id, step=step, every_slot=every_slot))
    if as_json:
        print_json(jsonable(b))
        return
    scope = f"step {step}" if step is not None else "the run"
    p = b["p"]
    out_console.print(
        f"run {run_id}: measured zero-variance fraction p = {num(p)} "
        f"({b['zero_variance_groups']} of {b['finished_groups']} finished groups)",
        markup=False,
    )
    if not b["use_dynamic_sampling"]:
        out_console.print("dynamic sampling is off: no filter budget is spent", markup=False)
    elif p is None:
        out_console.print("no finished group yet: the risk cannot be estimated", markup=False)
    else:
        out_console.print(
            f"filter budget {b['filter_budget']} per slot over {b['max_num_steps']} steps x "
            f"{b['num_prompts_per_step']} slots: budget_exhaustion_risk = "
            f"{b['budget_exhaustion_risk']:.3g} (probability that some slot exhausts it), expected "
            f"exhausted slots p**(budget+1)*N*max_num_steps = {b['expected_exhausted_slots']:.3g}",
            markup=False,
        )
        if b["budget_for_1pct_risk"] is not None and b["budget_for_1pct_risk"] > b["filter_budget"]:
            warn(
                f"at this p, grpo.dynamic_sampling_max_replacements_per_slot >= "
                f"{b['budget_for_1pct_risk']} keeps the risk below 1%"
            )
    histogram = ", ".join(f"{k}: {v}" for k, v in b["filter_replacements_histogram"].items())
    out_console.print(
        f"in {scope}: {b['slots_total']} slots; filter replacements {b['filter_replacements']} "
        f"(max {b['max_filter_replacements']} in one slot; slots by count {{{histogram}}}); drop "
        f"replacements {b['drop_replacements']} (max {b['max_drop_replacements']}, budget "
        f"{b['drop_budget']}, {b['on_dropped_prompt']}); {b['drops']} dropped prompts, "
        f"{b['infra_failures']} infra and {b['data_failures']} data failures",
        markup=False,
    )
    if not b["slots"]:
        note("no slot has used any budget" if not every_slot else "no slots")
        return
    print_table(
        [
            {
                "step": r["step"],
                "slot": r["slot"],
                "status": r["status"],
                "filtered": r["filtered"],
                "filter used": f"{r['filter_replacements']}/{r['filter_budget']}",
                "filter left": r["filter_budget_left"],
                "infra": r["infra_failures"],
                "data": r["data_failures"],
                "drops": r["drops"],
                "drop used": f"{r['drop_replacements']}/{r['drop_budget']}",
                "drop left": r["drop_budget_left"],
                "borrowed": r["borrowed_in"],
                "lent": r["lent_out"],
            }
            for r in b["slots"]
        ],
        title="slots that used a budget" if not every_slot else "slots",
    )


# --- refill workers -------------------------------------------------------------------------


def workers(
    database_url: DatabaseUrl = None,
    run: Annotated[int | None, typer.Option("--run", help="Only attempts of this run.")] = None,
    since: Annotated[float, typer.Option(help="Also list workers that finished work in the last SECONDS.", min=0)] = 600.0,
    as_json: AsJson = False,
) -> None:
    """Show the live fleet: attempts in flight and last heartbeat per worker.

    The last heartbeat is leased_until - lease_seconds (a heartbeat pushes the lease out);
    also the soonest lease expiry, leases already expired, and the work finished recently.
    Trainers show the step they hold."""
    from refill.admin.fleet_queries import queue_counts, worker_rows

    now = datetime.now(UTC)
    rows, waiting = read(
        database_url, lambda s: (worker_rows(s, run_id=run, since_seconds=since, now=now), queue_counts(s, run_id=run))
    )
    if as_json:
        print_json(jsonable({"now": now, "workers": rows, "waiting": waiting}))
        return
    if rows:
        print_table(
            [
                {
                    "worker": r["worker"],
                    "role": r["role"],
                    "in flight": r["in_flight"],
                    "runs": ",".join(str(x) for x in r["runs"]),
                    "last heartbeat": ago(r["last_heartbeat"], now),
                    "lease expires": ago(r["lease_expires"], now),
                    "expired": r["expired_leases"] or None,
                    "oldest started": ago(r["oldest_started_at"], now),
                    f"done {since:g}s": r["finished_recently"],
                    "failed": r["failed_recently"],
                    "last done": ago(r["last_finished_at"], now),
                }
                for r in rows
            ],
            title="workers",
        )
    else:
        note(f"no worker holds an attempt or finished one in the last {since:g}s")
    out_console.print(
        f"waiting for a worker: {waiting['pending']} pending (not yet on the queue), "
        f"{waiting['queued']} queued",
        markup=False,
    )
    expired = sum(r["expired_leases"] for r in rows)
    if expired:
        warn(f"{expired} leases expired without a heartbeat: those workers are stuck or gone (the reaper retries them)")


# --- refill tail ----------------------------------------------------------------------------


def tail(
    run_id: RunId,
    database_url: DatabaseUrl = None,
    interval: Annotated[float, typer.Option(help="Seconds between reads of the ledger.", min=0.05)] = 1.0,
    once: Annotated[bool, typer.Option("--once", help="Print the current progress and exit.")] = False,
) -> None:
    """Follow a run's progress until it ends (Ctrl-C stops following).

    The steps filling now and the metrics of each trained step. On a terminal it is the live display of `refill run start`; otherwise one line per change.
    Exit 0 when the run completes (or stops), 1 when it fails."""
    from refill.admin.progress_queries import RunProgress, run_progress, step_metrics
    from refill.admin.snapshot import read_snapshot

    with ledger_for(database_url) as ledger:

        def poll() -> tuple[RunProgress, list[dict[str, Any]]]:
            with read_snapshot(ledger) as session:
                try:
                    return run_progress(session, run_id), step_metrics(session, run_id)
                except LookupError as error:
                    fail(str(error), EXIT_BAD_INPUT)

        progress, history = poll()
        if once:
            _print_progress(progress, history)
            return
        printed: set[int] = set()
        last_open = ""
        try:
            if err_console.is_terminal:
                from refill.admin.progress import RunDisplay

                with RunDisplay(err_console) as display:
                    while True:
                        display.update(progress, history)
                        if _ended(progress):
                            break
                        time.sleep(interval)
                        progress, history = poll()
            else:
                while True:
                    for row in history:
                        if row.get("reward") is not None and row["step"] not in printed:
                            printed.add(row["step"])
                            out_console.print(_step_line(row), markup=False)
                    opened = ", ".join(f"step {s.step} {s.committed}/{s.target} {s.status}" for s in progress.open_steps)
                    if opened != last_open and not _ended(progress):
                        last_open = opened
                        out_console.print(f"filling: {opened or '-'}", markup=False)
                    if _ended(progress):
                        break
                    time.sleep(interval)
                    progress, history = poll()
        except KeyboardInterrupt:
            note(f"stopped following run {run_id}; the run itself goes on (`refill tail {run_id}` to follow again)")
            raise typer.Exit(130) from None
    out_console.print(
        f"run {run_id} {progress.status} ({progress.end_reason or '-'}): {progress.trained_steps} of "
        f"{progress.max_num_steps} steps trained, weights v{progress.weight_version}",
        markup=False,
    )
    if progress.status == "failed":
        err_console.print(progress.error or "", markup=False)
        raise typer.Exit(EXIT_INVALID)


def _ended(progress: Any) -> bool:
    from refill.admin.snapshot import FINISHED_RUN_STATES

    return progress.status in FINISHED_RUN_STATES


def _step_line(row: dict[str, Any]) -> str:
    def f(key: str, digits: int = 3) -> str:
        value = row.get(key)
        return "-" if value is None else f"{value:.{digits}f}"

    return (
        f"step {row['step']}: reward {f('reward')} (unfiltered {f('unfiltered_reward')}, first-attempt "
        f"{f('first_attempt_reward')}, zero-var {f('zero_variance_fraction', 2)}, filtered "
        f"{row.get('filtered_groups')}, fill {f('step_fill_seconds', 2)}s)"
    )


def _print_progress(progress: Any, history: list[dict[str, Any]]) -> None:
    from refill.admin.progress import metrics_table

    out_console.print(
        f"run {progress.run_id} ({progress.name}) {progress.status}: {progress.trained_steps} of "
        f"{progress.max_num_steps} steps trained, weights v{progress.weight_version}, spare pool "
        f"{progress.spare_pool}",
        markup=False,
    )
    for s in progress.open_steps:
        out_console.print(f"step {s.step}: {s.committed}/{s.target} {s.status}", markup=False)
    trained = [r for r in history if r.get("reward") is not None]
    if trained:
        show(metrics_table(trained[-8:], title="last steps"))

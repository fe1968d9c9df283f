"""`refill runs | run show | steps | slots | slot | budget | workers`: read the ledger.

Every command takes `--database-url` (default REFILL_DATABASE_URL, else the embedded ledger),
prints a rich table for people or, with `--json`, JSON for scripts, and reads one consistent
snapshot of the ledger (`refill.admin.snapshot.read_snapshot`). An unknown run, step or slot is
one `error:` line and exit 2. The questions themselves live in `refill.admin.*_queries`;
`refill tail` is `refill.admin.tail_command`.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

import typer

from refill.admin.console import (
    err_console,
    note,
    out_console,
    print_json,
    print_table,
    print_yaml,
    warn,
)
from refill.admin.inspect_common import (
    LEDGER_INT_MAX,
    AsJson,
    DatabaseUrl,
    RunId,
    ago,
    clock,
    first_line,
    jsonable,
    num,
    read,
    when,
)


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


# --- refill runs ----------------------------------------------------------------------------


def runs(
    database_url: DatabaseUrl = None,
    status: Annotated[RunStatusChoice | None, typer.Option(help="Only runs in this state.")] = None,
    limit: Annotated[int | None, typer.Option(help="At most this many, newest first.", min=1, max=LEDGER_INT_MAX)] = None,
    as_json: AsJson = False,
) -> None:
    """List the runs in the ledger, newest first.

    With each: its state, how many steps it trained, its weight version and batch shape, its
    share of a shared fleet (run.share) and its attempts in flight (running on a worker +
    queued on the broker)."""
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
                "share": "?" if r["share"] is None else f"{r['share']:g}",
                "in flight": _in_flight(r) or None,
                "created (UTC)": when(r["created_at"]),
                "seconds": num(r["seconds"], 1),
            }
            for r in rows
        ]
    )


def _in_flight(row: dict[str, Any]) -> str:
    """`R running + Q queued`, or '' when neither."""
    if not row["running"] and not row["queued"]:
        return ""
    return f"{row['running']} running + {row['queued']} queued"


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
        ("zero-variance fraction", f"{num(d['zero_variance_fraction']) or '-'} ({d['zero_variance_groups']} of {d['finished_groups']} finished groups)"),
        ("mean reward", f"first steps {num(d['mean_reward_first_steps']) or '-'}, last steps {num(d['mean_reward_last_steps']) or '-'}"),
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
    step: Annotated[
        int | None,
        typer.Option("--step", help="The step (default: every step not yet trained).", min=0, max=LEDGER_INT_MAX),
    ] = None,
    status: Annotated[SlotStatusChoice | None, typer.Option(help="Only slots in this state.")] = None,
    database_url: DatabaseUrl = None,
    as_json: AsJson = False,
) -> None:
    """Show a step's slots: state, group, live attempt, budgets, failures.

    `--status open` lists the slots a step is waiting on; without --step, the slots of every
    step not yet trained."""
    from refill.admin.slot_queries import slot_rows
    from refill.models.clock import ledger_now

    # An attempt's age ("since") on the ledger's clock, which wrote its start: an operator's
    # machine whose clock is off would otherwise show every attempt minutes older or younger.
    rows, now = read(
        database_url,
        lambda s: (slot_rows(s, run_id, step=step, status=status.value if status else None), ledger_now(s)),
    )
    if as_json:
        print_json(jsonable(rows))
        return
    if not rows:
        where = f"step {step}" if step is not None else "the steps not yet trained"
        note(f"run {run_id}: no {status.value + ' ' if status else ''}slots in {where}")
        return
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
    step: Annotated[int, typer.Argument(metavar="STEP", show_default=False, min=0, max=LEDGER_INT_MAX)],
    index: Annotated[int, typer.Argument(metavar="SLOT", show_default=False, min=0, max=LEDGER_INT_MAX)],
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
    step: Annotated[int | None, typer.Option("--step", help="Only this step's slots.", min=0, max=LEDGER_INT_MAX)] = None,
    every_slot: Annotated[bool, typer.Option("--all", help="List every slot, not only those that used a budget.")] = False,
    as_json: AsJson = False,
) -> None:
    """Show budget use per slot, the zero-variance fraction p and the exhaustion risk.

    The dynamic-sampling (filter) and fault-tolerance (drop) budgets of each slot, used and
    left; budget_exhaustion_risk is the probability that some slot of the run exhausts its
    filter budget, `1 - (1 - p**(budget+1))**(N * max_num_steps)`; the expected number of
    exhausted slots is `p**(budget+1) * N * max_num_steps`."""
    from refill.admin.budget_queries import budget_report

    b = read(database_url, lambda s: budget_report(s, run_id, step=step, every_slot=every_slot))
    if as_json:
        print_json(jsonable(b))
        return
    scope = f"step {step}" if step is not None else "the run"
    p = b["p"]
    out_console.print(
        f"run {run_id}: measured zero-variance fraction p = {num(p) or '-'} "
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
    counts = ", ".join(f"{k}: {v}" for k, v in b["filter_replacements_histogram"].items())
    histogram = f"{{{counts}}}" if counts else "none"
    out_console.print(
        f"in {scope}: {b['slots_total']} slots; filter replacements {b['filter_replacements']} "
        f"(max {b['max_filter_replacements']} in one slot; slots by count {histogram}); drop "
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
    run: Annotated[int | None, typer.Option("--run", help="Only attempts of this run.", min=1, max=LEDGER_INT_MAX)] = None,
    since: Annotated[
        float, typer.Option(help="Also list workers that finished work in the last SECONDS.", min=0, max=1e10)
    ] = 600.0,
    as_json: AsJson = False,
) -> None:
    """Show the live fleet: attempts in flight and last heartbeat per worker, and how the
    running runs share it.

    The last heartbeat is leased_until - lease_seconds (a heartbeat pushes the lease out);
    also the soonest lease expiry, leases already expired, and the work finished recently.
    Trainers show the step they hold. Per running run: its share (run.share), the part of the
    fleet it is entitled to among the running runs, its attempts running and queued, and the
    part of the fleet's running attempts it holds now."""
    from refill.admin.fleet_queries import fleet_shares, queue_counts, worker_rows
    from refill.models.clock import ledger_now

    def question(s):  # type: ignore[no-untyped-def]
        # Heartbeats and leases on the ledger's clock, which wrote them (not this machine's).
        now = ledger_now(s)
        return (
            now,
            worker_rows(s, run_id=run, since_seconds=since, now=now),
            queue_counts(s, run_id=run),
            fleet_shares(s, run_id=run),
        )

    now, rows, waiting, shares = read(database_url, question)
    if as_json:
        print_json(jsonable({"now": now, "workers": rows, "waiting": waiting, "runs": shares}))
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
    if shares:
        print_table(
            [
                {
                    "run": r["run_id"],
                    "name": r["name"],
                    "share": "?" if r["share"] is None else f"{r['share']:g}",
                    "entitled": _percent(r["entitled_fraction"]),
                    "running": r["running"],
                    "queued": r["queued"],
                    "of running": _percent(r["running_fraction"]),
                }
                for r in shares
            ],
            title="runs on the fleet",
        )
    out_console.print(
        f"waiting for a worker: {waiting['pending']} pending (not yet on the queue), "
        f"{waiting['queued']} queued",
        markup=False,
    )
    expired = sum(r["expired_leases"] for r in rows)
    if expired:
        warn(f"{expired} leases expired without a heartbeat: those workers are stuck or gone (the reaper retries them)")


def _percent(fraction: float | None) -> str | None:
    return None if fraction is None else f"{100 * fraction:.0f}%"

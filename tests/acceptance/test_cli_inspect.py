"""The inspection CLI (issue 5) against a real PostgreSQL ledger filled by a `sim` run.

One module-scoped fleet (real `refill worker` subprocesses on Redis and PostgreSQL) runs one
short simulated run with filtering, borrowing and a few infra failures. While it runs, a real
`refill tail` subprocess follows it. Then every command is called (through typer's CliRunner,
and `refill tail` / `refill check` through the installed `refill` script) and its numbers are
compared with the ledger's rows, queried directly or through the views of migration 0002.

`refill check` must pass on the clean run and name each violation that a test injects by
corrupting rows. Where the schema's own CHECK constraint or unique index forbids the corrupt
row, the test drops that constraint first (and restores it after), and says so: the point of
`refill check` is to catch a ledger whose constraints were lost or bypassed. Each injection is
undone after its test, and the run must then pass every check again.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import struct
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from typer.testing import CliRunner

from refill.admin.cli import app
from refill.admin.invariants import CHECKS, run_checks
from refill.admin.progress_queries import METRIC_COLUMNS
from refill.models import decisions
from refill.models.db import Ledger
from refill.models.leases import start_attempt
from refill.models.runs import start_run, stop_run

pytestmark = pytest.mark.timeout(300)

REFILL = Path(sys.executable).with_name("refill")
DOCS_SQL = Path(__file__).resolve().parents[2] / "docs" / "sql.md"
runner = CliRunner()

#: Small but busy: 8 slots x 6 steps, p ~ 0.4 zero-variance groups (filtered and replaced,
#: often by borrowing), 10% simulated infra failures (retried).
OVERRIDES: dict[str, Any] = {
    "grpo": {
        "num_prompts_per_step": 8,
        "max_num_steps": 6,
        "dynamic_sampling_max_replacements_per_slot": 8,
    },
    "generation": {"sim": {"failure_rate": 0.1}},
}
STEPS, SLOTS, BUDGET, LOOKAHEAD = 6, 8, 8, 1


@dataclass
class SimRun:
    url: str
    run_id: int
    tail_rc: int
    tail_out: str
    tail_err: str


@pytest.fixture(scope="module")
def sim_run(running_fleet, fleet_db: str) -> Iterator[SimRun]:  # type: ignore[no-untyped-def]
    assert REFILL.exists(), f"the refill script is not installed next to {sys.executable}"
    ledger = Ledger(fleet_db)
    run_id = running_fleet.create_run(ledger, OVERRIDES)
    # `refill tail` follows the run from before it starts until it ends.
    tail = subprocess.Popen(
        [str(REFILL), "tail", str(run_id), "--interval", "0.2"],
        env={**os.environ, "REFILL_DATABASE_URL": fleet_db},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        status = running_fleet.drive(ledger, run_id, timeout=120)
        out, err = tail.communicate(timeout=60)
    finally:
        if tail.poll() is None:
            tail.kill()
            tail.wait(10)
        ledger.dispose()
    assert status == "completed", running_fleet.tail_logs()
    yield SimRun(fleet_db, run_id, tail.returncode, out, err)


@pytest.fixture(scope="module")
def db(sim_run: SimRun) -> Iterator[Any]:
    engine = create_engine(sim_run.url)
    yield engine
    engine.dispose()


def sql(db: Any, statement: str, **params: Any) -> list[Any]:
    with db.connect() as connection:
        return list(connection.execute(text(statement), params).all())


def one(db: Any, statement: str, **params: Any) -> Any:
    rows = sql(db, statement, **params)
    assert len(rows) == 1, rows
    return rows[0][0] if len(rows[0]) == 1 else rows[0]


def cli(sim_run: SimRun, *args: str) -> Any:
    return runner.invoke(app, [*args, "--database-url", sim_run.url])


def cli_json(sim_run: SimRun, *args: str) -> Any:
    result = cli(sim_run, *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def view(db: Any, name: str, run_id: int, order: str, **where: Any) -> list[dict[str, Any]]:
    extra = "".join(f" AND {k} = :{k}" for k in where)
    with db.connect() as connection:
        return [
            dict(row)
            for row in connection.execute(
                text(f"SELECT * FROM {name} WHERE run_id = :run{extra} ORDER BY {order}"),
                {"run": run_id, **where},
            ).mappings()
        ]


# --- runs, run show, steps ----------------------------------------------------------------------


def test_runs_lists_the_run_with_its_progress(sim_run: SimRun) -> None:
    rows = cli_json(sim_run, "runs")
    row = next(r for r in rows if r["run_id"] == sim_run.run_id)
    assert row["status"] == "completed" and row["end_reason"] == "max_num_steps"
    assert row["trained_steps"] == STEPS and row["weight_version"] == STEPS
    assert row["num_prompts_per_step"] == SLOTS and row["seconds"] > 0
    table = cli(sim_run, "runs")
    assert table.exit_code == 0
    line = next(li for li in table.stdout.splitlines() if f" {sim_run.run_id} " in li and "fleet-test" in li)
    assert "completed" in line and f"{STEPS}/{STEPS}" in line


def test_run_show_counts_match_the_ledger(sim_run: SimRun, db: Any) -> None:
    detail = cli_json(sim_run, "run", "show", str(sim_run.run_id))
    run = sim_run.run_id
    by_state = dict(sql(db, "SELECT state, COUNT(*) FROM attempts WHERE run_id = :r GROUP BY state", r=run))
    assert detail["attempts"] == by_state
    assert by_state["filtered"] > 0 and by_state["failed"] > 0, "the sim run should filter and fail"
    zero, total = one(
        db,
        "SELECT SUM(CASE WHEN zero_variance THEN 1 ELSE 0 END), COUNT(*) FROM attempts "
        "WHERE run_id = :r AND zero_variance IS NOT NULL",
        r=run,
    )
    assert (detail["zero_variance_groups"], detail["finished_groups"]) == (zero, total)
    assert detail["zero_variance_fraction"] == pytest.approx(zero / total)
    assert detail["slots"] == {"committed": STEPS * SLOTS}
    assert detail["groups"]["trained"] == STEPS * SLOTS
    assert detail["spare_pool"] == one(
        db, "SELECT COUNT(*) FROM spare_prompts WHERE run_id = :r AND taken_at IS NULL", r=run
    )
    assert detail["use_dynamic_sampling"] is True and detail["filter_budget"] == BUDGET
    shown = cli(sim_run, "run", "show", str(run), "--config")
    assert shown.exit_code == 0
    assert "completed (max_num_steps)" in shown.stdout
    assert f"{zero} of {total} finished groups" in shown.stdout
    assert "dynamic_sampling_max_replacements_per_slot: 8" in shown.stdout  # the config snapshot


def test_steps_agree_with_the_step_summary_view(sim_run: SimRun, db: Any) -> None:
    rows = cli_json(sim_run, "steps", str(sim_run.run_id))
    assert [r["step"] for r in rows] == list(range(STEPS))
    summary = view(db, "step_summary", sim_run.run_id, "step")
    for mine, theirs in zip(rows, summary, strict=True):
        for key in (
            "status", "target", "committed", "shrunk", "open_slots", "attempts", "live_attempts",
            "committed_attempts", "filtered_attempts", "failed_attempts", "borrowed_in",
            "filter_replacements",
        ):
            assert mine[key] == theirs[key], (mine["step"], key)
        assert mine["reward"] == pytest.approx(theirs["reward"])
    # ...and with the tables themselves.
    filtered = one(db, "SELECT COUNT(*) FROM attempts WHERE run_id = :r AND state = 'filtered'", r=sim_run.run_id)
    assert sum(r["filtered_attempts"] for r in rows) == filtered
    assert all(r["status"] == "trained" and r["committed"] == r["target"] == SLOTS for r in rows)
    assert cli_json(sim_run, "steps", str(sim_run.run_id), "--status", "open") == []
    table = cli(sim_run, "steps", str(sim_run.run_id))
    assert table.exit_code == 0
    step0 = next(li for li in table.stdout.splitlines() if re.match(r"│\s+0 │ trained", li))
    assert f"{SLOTS}/{SLOTS}" in step0 and f"{rows[0]['reward']:.3f}" in step0


# --- slots, slot ---------------------------------------------------------------------------------


def test_slots_of_a_step(sim_run: SimRun, db: Any) -> None:
    rows = cli_json(sim_run, "slots", str(sim_run.run_id), "--step", "2")
    held = dict(sql(db, "SELECT idx, group_attempt_id FROM slots WHERE run_id = :r AND step = 2", r=sim_run.run_id))
    assert {r["slot"]: r["group_attempt_id"] for r in rows} == held
    versions = dict(
        sql(
            db,
            "SELECT s.idx, g.weight_version FROM slots s JOIN groups g ON g.attempt_id = s.group_attempt_id "
            "WHERE s.run_id = :r AND s.step = 2",
            r=sim_run.run_id,
        )
    )
    assert {r["slot"]: r["staleness"] for r in rows} == {i: 2 - v for i, v in versions.items()}
    assert all(r["status"] == "committed" and r["live_attempts"] == 0 for r in rows)
    budget_view = {r["slot_idx"]: r for r in view(db, "budget_use", sim_run.run_id, "slot_idx", step=2)}
    for r in rows:
        assert r["filter_replacements"] == budget_view[r["slot"]]["filter_replacements"]
        assert r["infra_failures"] == budget_view[r["slot"]]["infra_failures"]
    assert len(cli_json(sim_run, "slots", str(sim_run.run_id), "--step", "2", "--status", "committed")) == SLOTS
    assert cli_json(sim_run, "slots", str(sim_run.run_id), "--step", "2", "--status", "open") == []
    empty = cli(sim_run, "slots", str(sim_run.run_id), "--step", "2", "--status", "shrunk")
    assert empty.exit_code == 0 and "no shrunk slots in step 2" in empty.stderr


def test_slot_history_shows_a_borrowed_group_and_the_attempts_handed_over(sim_run: SimRun, db: Any) -> None:
    run = sim_run.run_id
    # A slot whose group was generated for another slot (SPEC §3.4: borrowing).
    borrowed = sql(
        db,
        "SELECT s.step, s.idx, a.id, a.step, a.slot_idx FROM slots s JOIN attempts a ON a.id = s.group_attempt_id "
        "WHERE s.run_id = :r AND a.slot_idx IS NOT NULL AND (a.step <> s.step OR a.slot_idx <> s.idx) "
        "ORDER BY s.step, s.idx LIMIT 1",
        r=run,
    )
    assert borrowed, "the sim run should have borrowed at least one group"
    step, idx, group, lender_step, lender_idx = borrowed[0]
    history = cli_json(sim_run, "slot", str(run), str(step), str(idx))
    assert history["group_attempt_id"] == group and history["borrowed"] is True
    assert history["group_source"].startswith(f"slot ({lender_step}, {lender_idx})")
    relations = {a["attempt_id"]: (a["relation"], a["holds_group"]) for a in history["attempts"]}
    from_view = {
        r["attempt_id"]: (r["relation"], bool(r["holds_group"]))
        for r in view(db, "slot_history", run, "attempt_id", step=step, slot_idx=idx)
    }
    assert relations == from_view
    assert relations[group] == ("borrowed_in", True)
    # Every attempt dispatched for or aimed at the slot is listed, with its prompt and outcome.
    expected = {
        a
        for (a,) in sql(
            db,
            "SELECT id FROM attempts WHERE run_id = :r AND ((step = :s AND slot_idx = :i) "
            "OR (origin_step = :s AND origin_slot = :i) OR id = :g)",
            r=run, s=step, i=idx, g=group,
        )
    }
    assert set(relations) == expected
    for attempt in history["attempts"]:
        prompt, worker, version, rewards = one(
            db,
            "SELECT p.text, a.worker, a.weight_version, a.rewards FROM attempts a JOIN prompts p ON p.id = a.prompt_id "
            "WHERE a.id = :a",
            a=attempt["attempt_id"],
        )
        assert (attempt["prompt"], attempt["worker"], attempt["weight_version"], attempt["rewards"]) == (
            prompt, worker, version, rewards,
        )
    assert history["attempts"][[a["attempt_id"] for a in history["attempts"]].index(group)]["outcome"] == (
        f"committed, trained in slot ({step}, {idx})"
    )
    table = cli(sim_run, "slot", str(run), str(step), str(idx))
    assert table.exit_code == 0
    assert f"its group was borrowed from slot ({lender_step}, {lender_idx})" in table.stdout
    assert f"borrowed_in ({lender_step}, {lender_idx})" in table.stdout


def test_slot_history_shows_a_failed_attempt_with_its_error(sim_run: SimRun, db: Any) -> None:
    step, idx, attempt_id, error = sql(
        db,
        "SELECT step, slot_idx, id, error FROM attempts WHERE run_id = :r AND state = 'failed' "
        "AND slot_idx IS NOT NULL ORDER BY id LIMIT 1",
        r=sim_run.run_id,
    )[0]
    history = cli_json(sim_run, "slot", str(sim_run.run_id), str(step), str(idx))
    failed = next(a for a in history["attempts"] if a["attempt_id"] == attempt_id)
    assert failed["outcome"] == "failed (infra)" and failed["error"] == error
    assert history["infra_failures"] >= 1
    table = cli(sim_run, "slot", str(sim_run.run_id), str(step), str(idx))
    assert "simulated infra failure" in table.stdout and "failed (infra)" in table.stdout


# --- budget, metrics, plot -----------------------------------------------------------------------


def test_budget_reports_use_p_and_the_exhaustion_risk(sim_run: SimRun, db: Any) -> None:
    run = sim_run.run_id
    report = cli_json(sim_run, "budget", str(run))
    zero, total = one(
        db,
        "SELECT SUM(zero_variance), SUM(finished) FROM filter_rate WHERE run_id = :r",
        r=run,
    )
    zero, total = int(zero), int(total)  # SUM of a bigint is numeric on PostgreSQL
    p = zero / total
    assert report["p"] == pytest.approx(p) and report["finished_groups"] == total
    assert report["budget_exhaustion_risk"] == pytest.approx(
        decisions.exhaustion_probability(p, BUDGET, SLOTS, STEPS)
    )
    assert report["expected_exhausted_slots"] == pytest.approx(p ** (BUDGET + 1) * SLOTS * STEPS)
    # The risk the run recorded at its last release used the same formula on the p of then.
    assert report["last_recorded_risk"]["step"] == STEPS - 1
    used = {
        (r["step"], r["slot_idx"]): r
        for r in view(db, "budget_use", run, "step, slot_idx")
        if r["filtered"] or r["filter_replacements"] or r["drops"] or r["infra_failures"] or r["data_failures"]
    }
    assert {(r["step"], r["slot"]) for r in report["slots"]} == set(used)
    for r in report["slots"]:
        theirs = used[(r["step"], r["slot"])]
        assert (r["filter_replacements"], r["filter_budget_left"], r["drop_budget_left"]) == (
            theirs["filter_replacements"], theirs["filter_budget_left"], theirs["drop_budget_left"],
        )
    assert sum(report["filter_replacements_histogram"].values()) == STEPS * SLOTS
    assert report["filter_replacements"] == one(
        db, "SELECT SUM(filter_replacements) FROM slots WHERE run_id = :r", r=run
    )
    assert len(cli_json(sim_run, "budget", str(run), "--all")["slots"]) == STEPS * SLOTS
    assert {r["step"] for r in cli_json(sim_run, "budget", str(run), "--step", "1")["slots"]} <= {1}
    table = cli(sim_run, "budget", str(run))
    assert table.exit_code == 0
    assert f"p = {p:.3f}" in table.stdout
    assert f"budget_exhaustion_risk = {report['budget_exhaustion_risk']:.3g}" in table.stdout


def test_metrics_table_csv_and_json_agree_with_the_ledger(sim_run: SimRun, db: Any) -> None:
    run = sim_run.run_id
    rows = cli_json(sim_run, "metrics", str(run))
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert set(METRIC_COLUMNS) <= set(rows[0])
    trained_reward = dict(
        sql(
            db,
            "SELECT s.step, AVG(g.reward_mean) FROM slots s JOIN groups g ON g.attempt_id = s.group_attempt_id "
            "WHERE s.run_id = :r GROUP BY s.step",
            r=run,
        )
    )
    for row in rows:
        assert row["reward"] == pytest.approx(trained_reward[row["step"]])
        assert row["trained_groups"] == SLOTS
    as_csv = cli(sim_run, "metrics", str(run), "--csv")
    assert as_csv.exit_code == 0
    parsed = list(csv.DictReader(io.StringIO(as_csv.stdout)))
    assert [int(r["step"]) for r in parsed] == list(range(STEPS))
    for line, row in zip(parsed, rows, strict=True):
        assert float(line["reward"]) == pytest.approx(row["reward"])
        assert int(line["filtered_groups"]) == row["filtered_groups"]
    table = cli(sim_run, "metrics", str(run))
    assert table.exit_code == 0 and f"{rows[-1]['reward']:.3f}" in table.stdout
    both = cli(sim_run, "metrics", str(run), "--csv", "--json")
    assert both.exit_code == 2 and "choose one of --csv and --json" in both.stderr


def png_chunks(path: Path) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    data = path.read_bytes()
    signature, chunks, at = data[:8], [], 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind = data[at + 4 : at + 8]
        chunks.append((kind, data[at + 8 : at + 8 + length]))
        at += 12 + length
    return signature, chunks


def test_plot_writes_a_png_with_the_named_series(sim_run: SimRun, tmp_path: Path) -> None:
    out = tmp_path / "run.png"
    result = cli(sim_run, "plot", str(sim_run.run_id), "-o", str(out), "--json")
    assert result.exit_code == 0, result.output
    expected = [
        "reward", "unfiltered_reward", "first_attempt_reward",
        "zero_variance_fraction",
        "step_fill_seconds", "trainer_idle_seconds",
        "rollouts_per_trained_group", "generated_tokens_per_trained_group", "skipped_prompts",
    ]
    assert json.loads(result.stdout)["series"] == expected
    signature, chunks = png_chunks(out)
    assert signature == b"\x89PNG\r\n\x1a\n"
    kind, header = chunks[0]
    width, height = struct.unpack(">II", header[:8])
    assert kind == b"IHDR" and (width, height) == (900, 900)
    assert chunks[-1][0] == b"IEND"
    # The legend labels drawn are kept in a tEXt chunk (figure.savefig(metadata=...)); they
    # are read from the figure's legends before saving, so they are what the image shows.
    texts = dict(body.split(b"\0", 1) for kind, body in chunks if kind == b"tEXt")
    assert texts[b"refill.series"].decode().split(",") == expected
    assert json.loads(texts[b"refill.steps"]) == list(range(STEPS))
    assert texts[b"refill.run"] == str(sim_run.run_id).encode()
    bad = cli(sim_run, "plot", str(sim_run.run_id), "-o", str(tmp_path / "run.svg"))
    assert bad.exit_code == 2 and "the plot is a PNG" in bad.stderr


# --- workers, tail -------------------------------------------------------------------------------


def test_workers_shows_attempts_in_flight_and_heartbeats(sim_run: SimRun, running_fleet, db: Any) -> None:  # type: ignore[no-untyped-def]
    from refill.models.admission import admit_steps

    # The fleet finished its run: its workers show recent work and nothing in flight.
    fleet = cli_json(sim_run, "workers")
    generate = next(w for w in fleet["workers"] if w["worker"] == "generate")
    finished = one(
        db,
        "SELECT COUNT(*) FROM attempts WHERE run_id = :r AND worker = 'generate' AND finished_at IS NOT NULL",
        r=sim_run.run_id,
    )
    assert generate["in_flight"] == 0 and generate["finished_recently"] >= finished
    assert sim_run.run_id in generate["runs"]
    trainer = next(w for w in fleet["workers"] if w["role"] == "train")
    assert trainer["finished_recently"] >= STEPS
    # A second run whose first attempts are leased by a worker that is not part of the fleet
    # (the ledger API a generation worker calls), and never relayed to the broker.
    ledger = Ledger(sim_run.url)
    run2 = running_fleet.create_run(ledger, OVERRIDES)
    try:
        ledger.transaction(lambda s: start_run(s, run2, "test-controller"))
        ledger.transaction(lambda s: admit_steps(s, run2))
        ids = [a for (a,) in sql(db, "SELECT id FROM attempts WHERE run_id = :r ORDER BY id LIMIT 3", r=run2)]
        for attempt_id in ids:
            assert ledger.transaction(lambda s, a=attempt_id: start_attempt(s, a, "gpu-test-7")) is not None
        live = cli_json(sim_run, "workers", "--run", str(run2))
        (row,) = [w for w in live["workers"] if w["worker"] == "gpu-test-7"]
        assert row["in_flight"] == 3 and row["runs"] == [run2] and row["expired_leases"] == 0
        started, leased = one(
            db, "SELECT MAX(started_at), MIN(leased_until) FROM attempts WHERE id = ANY(:ids)", ids=ids
        )
        # lease_seconds is 20 in the sim config: a heartbeat sets leased_until = now + 20 s.
        assert datetime.fromisoformat(row["last_heartbeat"]) == started
        assert datetime.fromisoformat(row["lease_expires"]) == leased
        pending = one(db, "SELECT COUNT(*) FROM attempts WHERE run_id = :r AND state = 'pending'", r=run2)
        assert live["waiting"] == {"pending": pending, "queued": 0} and pending > 0
        table = cli(sim_run, "workers", "--run", str(run2))
        line = next(li for li in table.stdout.splitlines() if "gpu-test-7" in li)
        assert re.search(r"│\s+3 │", line)
        assert f"{pending} pending" in table.stdout
    finally:
        ledger.transaction(lambda s: stop_run(s, run2))
        ledger.dispose()


def test_tail_followed_the_run_to_its_end(sim_run: SimRun) -> None:
    assert sim_run.tail_rc == 0, sim_run.tail_err
    lines = sim_run.tail_out.splitlines()
    rows = cli_json(sim_run, "metrics", str(sim_run.run_id))
    for row in rows:
        expected = f"step {row['step']}: reward {row['reward']:.3f} "
        assert any(line.startswith(expected) for line in lines), (expected, sim_run.tail_out)
    assert any(line.startswith("filling: ") for line in lines)
    assert lines[-1] == (
        f"run {sim_run.run_id} completed (max_num_steps): {STEPS} of {STEPS} steps trained, weights v{STEPS}"
    )
    once = cli(sim_run, "tail", str(sim_run.run_id), "--once")
    assert once.exit_code == 0 and f"{STEPS} of {STEPS} steps trained" in once.stdout


# --- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "show", "999"], "there is no run 999"),
        (["steps", "999"], "there is no run 999"),
        (["slots", "999", "--step", "0"], "there is no run 999"),
        (["slots", "{run}", "--step", "99"], "run {run} has no step 99 (its steps are 0..5)"),
        (["slot", "{run}", "99", "0"], "run {run} has no step 99"),
        (["slot", "{run}", "0", "42"], "step 0 of run {run} has no slot 42 (its slots are 0..7)"),
        (["budget", "999"], "there is no run 999"),
        (["metrics", "999"], "there is no run 999"),
        (["plot", "999", "-o", "/tmp/refill-never-written.png"], "there is no run 999"),
        (["workers", "--run", "999"], "there is no run 999"),
        (["tail", "999"], "there is no run 999"),
        (["check", "999"], "there is no run 999"),
        (["check", "{run}", "--only", "nonsense"], "no check named nonsense"),
    ],
)
def test_unknown_run_step_or_slot_is_one_line_and_exit_2(sim_run: SimRun, args: list[str], message: str) -> None:
    args = [a.replace("{run}", str(sim_run.run_id)) for a in args]
    result = cli(sim_run, *args)
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: " + message.replace("{run}", str(sim_run.run_id))), line
    assert result.stdout == "" and "Traceback" not in result.output


def test_a_password_in_the_url_is_never_printed(sim_run: SimRun) -> None:
    result = runner.invoke(app, ["runs", "--database-url", "postgresql://refill:s3cret@127.0.0.1:1/nowhere"])
    assert result.exit_code == 2
    assert "s3cret" not in result.output and "refill:***@127.0.0.1:1/nowhere" in result.stderr


# --- the views and docs/sql.md -------------------------------------------------------------------


def test_every_query_in_docs_sql_runs_on_the_ledger(sim_run: SimRun, db: Any) -> None:
    """docs/sql.md's example queries use psql variables (:run, :step, :slot); they run here
    as bind parameters, on the slot of step 1 that saw the most attempts."""
    blocks = re.findall(r"```sql\n(.*?)```", DOCS_SQL.read_text(), re.S)
    assert len(blocks) >= 10
    step, idx = sql(
        db,
        "SELECT step, slot_idx FROM slot_history WHERE run_id = :r GROUP BY step, slot_idx "
        "ORDER BY COUNT(*) DESC, step, slot_idx LIMIT 1",
        r=sim_run.run_id,
    )[0]
    values = {"run": sim_run.run_id, "step": step, "slot": idx}
    answers = []
    for block in blocks:
        params = {k: v for k, v in values.items() if f":{k}" in block}
        answers.append(sql(db, block, **params))
    # The run-level filter rate and the risk agree with `refill budget` and `refill run show`.
    rate = next(a for a, b in zip(answers, blocks, strict=True) if "SUM(finished) AS finished" in b)
    report = cli_json(sim_run, "budget", str(sim_run.run_id))
    detail = cli_json(sim_run, "run", "show", str(sim_run.run_id))
    run_id, finished, zero, filtered = (int(v) for v in rate[0][:4])  # SUMs are numeric on PostgreSQL
    filter_rate = rate[0][4]
    assert (run_id, finished, zero) == (sim_run.run_id, report["finished_groups"], report["zero_variance_groups"])
    assert filtered == detail["attempts"]["filtered"] and filter_rate == pytest.approx(filtered / finished)
    risk = next(a for a, b in zip(answers, blocks, strict=True) if "budget_exhaustion_risk" in b)
    assert risk[0][3] == pytest.approx(report["budget_exhaustion_risk"])
    assert risk[0][2] == pytest.approx(report["expected_exhausted_slots"])


def test_a_trained_groups_rollout_decodes_as_docs_sql_says(sim_run: SimRun, db: Any) -> None:
    from refill.models.rollout_codec import decode, unpack_payload

    rows = sql(
        db,
        "SELECT g.rollout, g.completion_texts, g.num_tokens, g.rewards, g.payload_ref, r.run_dir"
        " FROM groups g JOIN runs r ON r.id = g.run_id WHERE g.run_id = :r AND g.trained_step = 1",
        r=sim_run.run_id,
    )
    assert rows
    for rollout, texts, num_tokens, rewards, payload_ref, run_dir in rows:
        if payload_ref is None:
            texts = json.loads(texts) if isinstance(texts, str) else texts  # JSON text on SQLite
            prompt, completions = decode(rollout, texts)
        else:  # a claim check: the group is in the run's payload store
            prompt, completions = unpack_payload(Path(run_dir, "payloads", payload_ref).read_bytes())
        assert prompt and len(completions) == len(json.loads(rewards) if isinstance(rewards, str) else rewards)
        assert sum(len(c.token_ids) for c in completions) == num_tokens
        assert all(len(c.logprobs) == len(c.token_ids) for c in completions)


# --- refill check --------------------------------------------------------------------------------


def test_check_passes_on_the_clean_run(sim_run: SimRun) -> None:
    result = cli(sim_run, "check", str(sim_run.run_id))
    assert result.exit_code == 0, result.stdout
    assert f"run {sim_run.run_id}: all {len(CHECKS)} checks hold" in result.stdout
    report = cli_json(sim_run, "check", str(sim_run.run_id))
    assert report["ok"] is True and [c["name"] for c in report["checks"]] == [c.name for c in CHECKS]
    # The installed script, as an operator runs it.
    proc = subprocess.run(
        [str(REFILL), "check", str(sim_run.run_id)],
        env={**os.environ, "REFILL_DATABASE_URL": sim_run.url},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"all {len(CHECKS)} checks hold" in proc.stdout


@pytest.fixture
def restored(sim_run: SimRun) -> Iterator[None]:
    """After an injection test, the run is whole again (its corruption was undone)."""
    yield
    ledger = Ledger(sim_run.url)
    try:
        with ledger.session() as session:
            assert run_checks(session, sim_run.run_id).violations == []
    finally:
        ledger.dispose()


@contextmanager
def corrupted(db: Any, corrupt: list[str], restore: list[str], **params: Any) -> Iterator[None]:
    """Apply `corrupt` (committed, so the CLI sees it), and `restore` afterwards whatever
    happens. A lock timeout keeps an ALTER TABLE from waiting forever on a worker."""
    with db.begin() as connection:
        connection.execute(text("SET LOCAL lock_timeout = '10s'"))
        for statement in corrupt:
            connection.execute(text(statement), params)
    try:
        yield
    finally:
        with db.begin() as connection:
            connection.execute(text("SET LOCAL lock_timeout = '10s'"))
            for statement in restore:
                connection.execute(text(statement), params)


def violations(sim_run: SimRun) -> list[dict[str, Any]]:
    result = cli(sim_run, "check", str(sim_run.run_id), "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["ok"] is False
    return [v for c in report["checks"] for v in c["violations"]]


def found(items: list[dict[str, Any]], check: str, **where: Any) -> list[dict[str, Any]]:
    return [v for v in items if v["check"] == check and all(v[k] == w for k, w in where.items())]


def trained_slot(db: Any, run_id: int, step: int, idx: int) -> tuple[int, Any]:
    """The group of slot (step, idx) and its slot's settled_at."""
    return one(db, "SELECT group_attempt_id, settled_at FROM slots WHERE run_id = :r AND step = :s AND idx = :i",
               r=run_id, s=step, i=idx)


def test_check_names_a_group_committed_in_two_slots(sim_run: SimRun, db: Any, restored: None) -> None:
    run = sim_run.run_id
    g, _ = trained_slot(db, run, 3, 0)
    h, _ = trained_slot(db, run, 3, 1)
    # The unique index on slots.group_attempt_id forbids this row: the test drops it.
    with corrupted(
        db,
        ["DROP INDEX ix_slots_group_attempt_id",
         "UPDATE slots SET group_attempt_id = :g WHERE run_id = :r AND step = 3 AND idx = 1"],
        ["UPDATE slots SET group_attempt_id = :h WHERE run_id = :r AND step = 3 AND idx = 1",
         "CREATE UNIQUE INDEX ix_slots_group_attempt_id ON slots (group_attempt_id)"],
        g=g, h=h, r=run,
    ):
        items = violations(sim_run)
        twice = found(items, "slot_committed_twice", run_id=run, step=3, attempt=g)
        assert {v["slot"] for v in twice if "sits in 2 slots" in v["message"]} == {0, 1}
        # The group the slot held before was trained in step 3 and now sits nowhere.
        assert found(items, "slot_committed_twice", step=3, attempt=h, slot=None)
        text_out = cli(sim_run, "check", str(run)).stdout
        assert f"run {run}, step 3, slot 1, attempt {g}: group {g} sits in 2 slots: (3, 0), (3, 1)" in text_out
        assert "FAIL slot_committed_twice" in text_out


def test_check_names_a_group_trained_in_two_steps(sim_run: SimRun, db: Any, restored: None) -> None:
    run = sim_run.run_id
    g, _ = trained_slot(db, run, 2, 4)
    # No constraint covers groups.trained_step: the slot's group claims a second step.
    with corrupted(
        db,
        ["UPDATE groups SET trained_step = 3 WHERE attempt_id = :g"],
        ["UPDATE groups SET trained_step = 2 WHERE attempt_id = :g"],
        g=g,
    ):
        items = violations(sim_run)
        assert found(items, "slot_committed_twice", step=2, slot=4, attempt=g)
        assert found(items, "slot_committed_twice", step=3, attempt=g)


def test_check_names_a_trained_zero_variance_group(sim_run: SimRun, db: Any, restored: None) -> None:
    run = sim_run.run_id
    g, _ = trained_slot(db, run, 4, 2)
    rewards, flagged = one(db, "SELECT CAST(rewards AS TEXT), zero_variance FROM groups WHERE attempt_id = :g", g=g)
    flat = json.dumps([1.0] * len(json.loads(rewards)))
    # No constraint covers a group's rewards: the trained group's rewards become all equal.
    with corrupted(
        db,
        ["UPDATE groups SET rewards = CAST(:flat AS JSONB), zero_variance = TRUE WHERE attempt_id = :g"],
        ["UPDATE groups SET rewards = CAST(:rewards AS JSONB), zero_variance = :flagged WHERE attempt_id = :g"],
        g=g, flat=flat, rewards=rewards, flagged=flagged,
    ):
        items = violations(sim_run)
        (v,) = found(items, "zero_variance_trained")
        assert (v["run_id"], v["step"], v["slot"], v["attempt"]) == (run, 4, 2, g)
        assert "rewards are all 1" in v["message"] and "use_dynamic_sampling is on" in v["message"]


def test_check_names_a_budget_overrun(sim_run: SimRun, db: Any, restored: None) -> None:
    run = sim_run.run_id
    before = one(db, "SELECT filter_replacements FROM slots WHERE run_id = :r AND step = 1 AND idx = 6", r=run)
    # CHECK (filter_replacements <= filter_budget) forbids the overrun: the test drops it.
    with corrupted(
        db,
        ["ALTER TABLE slots DROP CONSTRAINT ck_slots_filter_budget",
         "UPDATE slots SET filter_replacements = filter_budget + 1 WHERE run_id = :r AND step = 1 AND idx = 6"],
        ["UPDATE slots SET filter_replacements = :before WHERE run_id = :r AND step = 1 AND idx = 6",
         "ALTER TABLE slots ADD CONSTRAINT ck_slots_filter_budget CHECK (filter_replacements <= filter_budget)"],
        r=run, before=before,
    ):
        items = violations(sim_run)
        overrun = found(items, "budget_exceeded", run_id=run, step=1, slot=6)
        assert any(
            v["message"] == f"{BUDGET + 1} filter replacements, past the dynamic-sampling budget of {BUDGET}"
            for v in overrun
        )
        assert {v["check"] for v in items} == {"budget_exceeded"}


def test_check_names_a_stale_group_beyond_the_bound(sim_run: SimRun, db: Any, restored: None) -> None:
    run = sim_run.run_id
    g, _ = trained_slot(db, run, 5, 3)
    version = one(db, "SELECT weight_version FROM groups WHERE attempt_id = :g", g=g)
    stale = 5 - LOOKAHEAD - 1
    # No constraint covers a group's weight version.
    with corrupted(
        db,
        ["UPDATE groups SET weight_version = :stale WHERE attempt_id = :g"],
        ["UPDATE groups SET weight_version = :version WHERE attempt_id = :g"],
        g=g, stale=stale, version=version,
    ):
        items = violations(sim_run)
        (v,) = found(items, "staleness_bound")
        assert (v["step"], v["slot"], v["attempt"]) == (5, 3, g)
        assert f"staleness {5 - stale}, past max_lookahead_versions={LOOKAHEAD}" in v["message"]


def test_check_names_a_released_step_that_is_not_full(sim_run: SimRun, db: Any, restored: None) -> None:
    run = sim_run.run_id
    g, settled = trained_slot(db, run, 2, 5)
    # The slot of a trained step is reopened (allowed by the slot's constraints, which only tie
    # status to group): the step's counter still says full, its slots do not.
    with corrupted(
        db,
        ["UPDATE slots SET status = 'open', group_attempt_id = NULL, settled_at = NULL "
         "WHERE run_id = :r AND step = 2 AND idx = 5"],
        ["UPDATE slots SET status = 'committed', group_attempt_id = :g, settled_at = :settled "
         "WHERE run_id = :r AND step = 2 AND idx = 5"],
        r=run, g=g, settled=settled,
    ):
        items = violations(sim_run)
        assert found(items, "released_step_not_full", step=2, slot=5)
        (whole,) = found(items, "released_step_not_full", step=2, slot=None)
        assert f"its slots hold {SLOTS - 1} committed, 0 shrunk, 1 open" in whole["message"]
        assert found(items, "step_counters", step=2)


def test_check_names_a_released_step_whose_counter_is_short(sim_run: SimRun, db: Any, restored: None) -> None:
    run = sim_run.run_id
    # CHECK (status = 'open' OR committed = num_slots - shrunk) forbids it: the test drops it.
    with corrupted(
        db,
        ["ALTER TABLE steps DROP CONSTRAINT ck_steps_released_steps_are_full",
         "UPDATE steps SET committed = committed - 1 WHERE run_id = :r AND step = 1"],
        ["UPDATE steps SET committed = committed + 1 WHERE run_id = :r AND step = 1",
         "ALTER TABLE steps ADD CONSTRAINT ck_steps_released_steps_are_full "
         "CHECK (status = 'open' OR committed = num_slots - shrunk)"],
        r=run,
    ):
        items = violations(sim_run)
        assert any(
            v["message"] == f"trained step counts {SLOTS - 1} committed groups of {SLOTS}"
            for v in found(items, "released_step_not_full", run_id=run, step=1)
        )

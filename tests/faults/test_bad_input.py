"""Scenario 9 of issue 6: bad input. Invalid configs and data sets are refused by
`refill run start` before anything reaches the ledger; bad output of a reward function or a
worker is a data failure of its attempt and the run goes on; results the ledger did not
dispatch, or does not hold in flight for that worker, are refused and recorded.

(JSON only on the wire — a pickle message refused by a real worker — is proven by
tests/acceptance/test_wire_format.py::test_pickle_messages_are_refused.)"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from refill.admin.cli import app as cli
from refill.models.admission import admit_steps
from refill.models.leases import start_attempt
from refill.models.payload import Completion, ResultMessage
from refill.models.tables import Attempt, Prompt, RejectedResult, Run
from refill.tasks.controller import Controller
from refill.tasks.queues import RESULTS, TASK_RECORD_RESULT
from tests.support.chaos_fleet import FAULT_RUN, assert_nothing_lost, fault_facts, wait_for
from tests.support.fleet import merged

pytestmark = pytest.mark.faults

runner = CliRunner()


def _ledger_rows(ledger) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    with ledger.session() as session:
        return (
            session.scalar(select(func.count()).select_from(Run)),
            session.scalar(select(func.count()).select_from(Prompt)),
        )


def _run_start(fleet, config: Path):  # type: ignore[no-untyped-def]
    return runner.invoke(cli, ["run", "start", str(config), "--quiet"], env=fleet.cli_env())


#: SPEC §5: each config that setup must refuse, and the key its message must name.
INVALID = {
    "one-generation-with-dynamic-sampling": (
        {"grpo": {"num_generations_per_prompt": 1}}, "grpo.num_generations_per_prompt"),
    "filter-budget-zero": (
        {"grpo": {"dynamic_sampling_max_replacements_per_slot": 0}},
        "grpo.dynamic_sampling_max_replacements_per_slot"),
    "no-replacement-attempts-under-replace": (
        {"rollout_failure": {"max_replacement_attempts": 0, "on_dropped_prompt": "replace"}},
        "rollout_failure.max_replacement_attempts"),
    "no-reserve-with-dynamic-sampling": (
        {"rollout_failure": {"replacement_reserve_prompts": 0}}, "rollout_failure.replacement_reserve_prompts"),
    "no-reserve-under-shrink": (
        {"rollout_failure": {"replacement_reserve_prompts": 0, "on_dropped_prompt": "shrink"}},
        "rollout_failure.replacement_reserve_prompts"),
    "batch-fraction-zero": (
        {"rollout_failure": {"min_step_batch_fraction": 0}}, "rollout_failure.min_step_batch_fraction"),
    "batch-fraction-above-one": (
        {"rollout_failure": {"min_step_batch_fraction": 1.5}}, "rollout_failure.min_step_batch_fraction"),
    "negative-lookahead": ({"async_rl": {"max_lookahead_versions": -1}}, "async_rl.max_lookahead_versions"),
    "sampler-that-cannot-assign-steps": (
        {"async_rl": {"sampler": {"name": "custom", "import_path": "tests.support.chaos_inputs:PlaceOnly"}}},
        "async_rl.sampler.import_path"),
    "reward-function-that-does-not-import": (
        {"reward": {"function": "tests.support.no_such_module:reward"}}, "reward.function"),
    "data-file-that-does-not-exist": (
        {"data": {"builtin": None, "train_path": "/nonexistent/refill-faults.jsonl"}}, "data.train_path"),
    "model-that-does-not-load": (
        {"generation": {"backend": "hf", "sim": None}, "model": {"name_or_path": "/nonexistent/refill-model"}},
        "model.name_or_path"),
    "unknown-key": ({"grpo": {"num_prompt_per_step": 8}}, "num_prompts_per_step"),
}


@pytest.mark.parametrize("case", list(INVALID), ids=list(INVALID))
def test_invalid_config_is_refused_before_the_ledger(fleet, fault_ledger, case: str) -> None:
    overrides, key = INVALID[case]
    config = fleet.write_config(overrides, name=f"invalid-{case}")
    before = _ledger_rows(fault_ledger)
    result = _run_start(fleet, config)
    assert result.exit_code == 1, result.output
    assert key in result.output, result.output
    assert "Fix" in result.output or "did you mean" in result.output.lower(), result.output
    assert _ledger_rows(fault_ledger) == before


def test_malformed_data_rows_are_reported_with_line_numbers(fleet, fault_ledger, tmp_path: Path) -> None:
    rows = [json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(40)]
    rows[2] = '{"prompt": "2+1=", "answer": '  # line 3: not JSON
    rows[4] = json.dumps({"answer": "5"})  # line 5: no prompt field
    rows[6] = json.dumps(["7+1=", "8"])  # line 7: not an object
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join(rows) + "\n")
    config = fleet.write_config({"data": {"builtin": None, "train_path": str(data)}}, name="bad-rows")
    before = _ledger_rows(fault_ledger)
    result = _run_start(fleet, config)
    assert result.exit_code == 1, result.output
    assert "3 problems:" in result.output, result.output
    assert "bad.jsonl line 3 is not valid JSON" in result.output
    assert "bad.jsonl line 5 has no 'prompt' field" in result.output
    assert "bad.jsonl line 7 is a JSON array, not an object" in result.output
    assert _ledger_rows(fault_ledger) == before


#: Enough replacements per slot that a prompt the data breaks never shrinks a step.
FORGIVING = {"rollout_failure": {"max_replacement_attempts": 8}, "grpo": {"max_num_steps": 6}}


def _errors(ledger, run_id: int) -> list[str]:  # type: ignore[no-untyped-def]
    with ledger.session() as session:
        return list(
            session.scalars(select(Attempt.error).where(Attempt.run_id == run_id, Attempt.failure_kind == "data"))
        )


def test_reward_function_that_raises_or_returns_nan(fleet, fault_ledger) -> None:
    run_id = fleet.create_run(
        fault_ledger, merged(FAULT_RUN, merged(FORGIVING, {"reward": {"function": "tests.support.chaos_inputs:raises_or_nan"}}))
    )
    started = time.monotonic()
    assert fleet.drive(fault_ledger, run_id) == "completed"
    with fault_ledger.session() as session:
        facts = fault_facts(session, run_id)
    errors = _errors(fault_ledger, run_id)
    raised = sum("raised ValueError: reward function broke" in e for e in errors)
    nan = sum("returned nan, not a finite number" in e for e in errors)
    print(facts.line("reward-raises-or-nan", time.monotonic() - started, raised=raised, nan=nan))
    assert_nothing_lost(facts, steps=6)
    assert raised >= 1 and nan >= 1, errors
    assert facts.failed == {"data": len(errors)}


def test_worker_returns_wrong_group_size_or_oversized_payload(fleet, fault_ledger) -> None:
    run_id = fleet.create_run(
        fault_ledger,
        merged(FAULT_RUN, merged(FORGIVING, {
            "generation": {"sim": {"wrong_group_size_rate": 0.05, "oversized_rate": 0.05}},
            "infra": {"max_result_bytes": 8192},
        })),
    )
    started = time.monotonic()
    assert fleet.drive(fault_ledger, run_id) == "completed"
    with fault_ledger.session() as session:
        facts = fault_facts(session, run_id)
    errors = _errors(fault_ledger, run_id)
    wrong_size = sum("group has 7 completions, the run expects 8" in e for e in errors)
    oversized = sum("exceeds infra.max_result_bytes=8192" in e for e in errors)
    print(facts.line("wrong-group-size-or-oversized", time.monotonic() - started, wrong_size=wrong_size, oversized=oversized))
    assert_nothing_lost(facts, steps=6)
    assert wrong_size >= 1 and oversized >= 1, errors
    assert wrong_size + oversized == len(errors)


def test_results_the_ledger_does_not_hold_in_flight_are_refused(fleet, fault_ledger) -> None:
    """Only a result for an attempt the ledger dispatched and holds in flight, from the worker
    that holds its lease, is recorded; everything else is refused and kept in
    rejected_results. An oversized result from the lease holder is a data failure even though
    no worker refused to send it."""
    run_id = fleet.create_run(fault_ledger, merged(FAULT_RUN, {"grpo": {"max_num_steps": 3}, "infra": {"max_result_bytes": 8192}}))
    controller = Controller(fault_ledger, fleet.app, run_id)
    controller.start()
    fault_ledger.transaction(lambda s: admit_steps(s, run_id))  # attempts pending, nothing sent yet
    with fault_ledger.session() as session:
        leased, unleased = session.scalars(
            select(Attempt.id).where(Attempt.run_id == run_id, Attempt.step == 0).order_by(Attempt.id).limit(2)
        ).all()
    assert fault_ledger.transaction(lambda s: start_attempt(s, leased, "forger")) is not None
    genuine = ResultMessage(
        run_id=run_id, attempt_id=leased, worker="forger", weight_version=0, prompt_token_ids=[1, 2, 3],
        completions=[Completion([1, 2], [-0.5, -0.5], "<sim:solved>") for _ in range(8)],
        rewards=[1.0, 0.0] * 4,
    )

    def send(body: dict) -> None:
        fleet.app.send_task(TASK_RECORD_RESULT, args=[body], queue=RESULTS, routing_key=RESULTS, serializer="json")

    def rejected(attempt_id: int) -> list[tuple[str, str]]:
        with fault_ledger.session() as session:
            rows = session.execute(
                select(RejectedResult.reason, RejectedResult.detail)
                .where(RejectedResult.attempt_id == attempt_id)
                .order_by(RejectedResult.id)
            ).all()
            return [(reason, detail) for reason, detail in rows]

    never = 10**12
    send(dataclasses.replace(genuine, attempt_id=never).to_json())
    send(dataclasses.replace(genuine, attempt_id=unleased).to_json())
    send(dataclasses.replace(genuine, worker="impostor").to_json())
    send({"run_id": run_id, "attempt_id": never + 1, "rewards": "not a list"})
    wait_for(lambda: rejected(never) and rejected(unleased) and rejected(leased) and rejected(never + 1), 30, "refusals")
    assert rejected(never) == [("unknown", "the ledger never dispatched this attempt")]
    assert rejected(unleased)[0][0] == "unknown" and "not leased" in rejected(unleased)[0][1]
    assert rejected(leased) == [("unknown", "attempt is leased to forger, not impostor")]
    assert rejected(never + 1)[0][0] == "malformed"
    consumer_log = fleet.log(fleet.names("consume")[0])
    assert f"result for attempt {never} refused: UNKNOWN" in consumer_log
    assert "refused malformed result" in consumer_log

    oversized = [Completion([1, 2], [-0.5, -0.5], "x" * 5000) for _ in range(8)]
    send(dataclasses.replace(genuine, completions=oversized).to_json())
    wait_for(lambda: fault_ledger.transaction(lambda s: s.get(Attempt, leased).state) == "failed", 30, "data failure")
    with fault_ledger.session() as session:
        attempt = session.get(Attempt, leased)
        assert attempt.failure_kind == "data" and "refused by the consumer" in attempt.error
    send(genuine.to_json())  # too late: the attempt is settled
    wait_for(lambda: len(rejected(leased)) == 2, 30, "duplicate refused")
    assert rejected(leased)[1][0] == "duplicate"

    # The run is none the worse for it.
    assert controller.run(max_seconds=120) == "completed"
    with fault_ledger.session() as session:
        facts = fault_facts(session, run_id)
    print(facts.line("forged-results", 0.0))
    assert_nothing_lost(facts, steps=3)

"""Views for the questions operators ask in `psql`: step summary, slot history, budget use,
filter rate per step (see docs/sql.md for example queries).

The SQL is portable (PostgreSQL and SQLite): CASE instead of FILTER, CAST(... AS FLOAT) for
ratios, booleans read with `CASE WHEN col THEN ...` (SQLite stores them as 0/1). Views are not
in the models, and autogenerate compares tables only, so they never show up as a difference.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-09 10:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LIVE = "('pending', 'queued', 'running')"

#: One row per step: its counters, what its slots and attempts did, and its metrics.
STEP_SUMMARY = f"""
CREATE VIEW step_summary AS
SELECT
    s.run_id,
    s.step,
    s.status,
    s.num_slots,
    s.num_slots - s.shrunk AS target,
    s.committed,
    s.shrunk,
    s.dropped_shrunk,
    COALESCE(sl.open_slots, 0) AS open_slots,
    COALESCE(sl.filter_replacements, 0) AS filter_replacements,
    COALESCE(sl.drop_replacements, 0) AS drop_replacements,
    COALESCE(sl.borrowed_in, 0) AS borrowed_in,
    COALESCE(a.attempts, 0) AS attempts,
    COALESCE(a.live_attempts, 0) AS live_attempts,
    COALESCE(a.committed_attempts, 0) AS committed_attempts,
    COALESCE(a.filtered_attempts, 0) AS filtered_attempts,
    COALESCE(a.failed_attempts, 0) AS failed_attempts,
    COALESCE(a.cancelled_attempts, 0) AS cancelled_attempts,
    s.admitted_at,
    s.released_at,
    s.train_started_at,
    s.trained_at,
    m.reward,
    m.unfiltered_reward,
    m.first_attempt_reward,
    m.zero_variance_fraction,
    m.staleness_mean,
    m.staleness_max,
    m.step_fill_seconds,
    m.trainer_idle_seconds,
    m.loss
FROM steps s
LEFT JOIN (
    SELECT
        run_id,
        step,
        SUM(CASE WHEN status = 'open' THEN 1 ELSE 0 END) AS open_slots,
        SUM(filter_replacements) AS filter_replacements,
        SUM(drop_replacements) AS drop_replacements,
        SUM(borrowed_in) AS borrowed_in
    FROM slots
    GROUP BY run_id, step
) sl ON sl.run_id = s.run_id AND sl.step = s.step
LEFT JOIN (
    SELECT
        run_id,
        step,
        COUNT(*) AS attempts,
        SUM(CASE WHEN state IN {LIVE} THEN 1 ELSE 0 END) AS live_attempts,
        SUM(CASE WHEN state = 'committed' THEN 1 ELSE 0 END) AS committed_attempts,
        SUM(CASE WHEN state = 'filtered' THEN 1 ELSE 0 END) AS filtered_attempts,
        SUM(CASE WHEN state = 'failed' THEN 1 ELSE 0 END) AS failed_attempts,
        SUM(CASE WHEN state = 'cancelled' THEN 1 ELSE 0 END) AS cancelled_attempts
    FROM attempts
    GROUP BY run_id, step
) a ON a.run_id = s.run_id AND a.step = s.step
LEFT JOIN step_metrics m ON m.run_id = s.run_id AND m.step = s.step
"""

_ATTEMPT_COLUMNS = """
    a.origin_step,
    a.origin_slot,
    a.step AS aimed_step,
    a.slot_idx AS aimed_slot,
    a.reason,
    a.try_no,
    a.state,
    a.failure_kind,
    a.prompt_id,
    a.worker,
    a.min_weight_version,
    a.weight_version,
    a.reward_mean,
    a.reward_min,
    a.reward_max,
    a.zero_variance,
    a.num_tokens,
    a.generation_seconds,
    a.created_at,
    a.dispatched_at,
    a.started_at,
    a.leased_until,
    a.finished_at,
    a.error"""

_NOT_AIMED_HERE = "(a.slot_idx IS NULL OR a.step <> sl.step OR a.slot_idx <> sl.idx)"
_NOT_FROM_HERE = "(a.origin_slot IS NULL OR a.origin_step <> sl.step OR a.origin_slot <> sl.idx)"

#: Every attempt that touched a slot, one row per (slot, attempt):
#:   own          dispatched for the slot and still aimed at it
#:   reaimed_in   dispatched for another slot, handed over to this one
#:   reaimed_out  dispatched for this slot, handed over to another (or made an extra)
#:   borrowed_in  its group sits here, but it was generated for another slot
#:   extra_in     its group sits here, and it was an over-dispatched extra
#: holds_group is 1 for the attempt whose group the slot holds now.
SLOT_HISTORY = f"""
CREATE VIEW slot_history AS
SELECT
    sl.run_id,
    sl.step,
    sl.idx AS slot_idx,
    sl.status AS slot_status,
    a.id AS attempt_id,
    CASE WHEN a.origin_step = sl.step AND a.origin_slot = sl.idx THEN 'own' ELSE 'reaimed_in' END
        AS relation,
    CASE WHEN sl.group_attempt_id = a.id THEN 1 ELSE 0 END AS holds_group,{_ATTEMPT_COLUMNS}
FROM slots sl
JOIN attempts a ON a.run_id = sl.run_id AND a.step = sl.step AND a.slot_idx = sl.idx
UNION ALL
SELECT
    sl.run_id,
    sl.step,
    sl.idx,
    sl.status,
    a.id,
    'reaimed_out',
    CASE WHEN sl.group_attempt_id = a.id THEN 1 ELSE 0 END,{_ATTEMPT_COLUMNS}
FROM slots sl
JOIN attempts a ON a.run_id = sl.run_id AND a.origin_step = sl.step AND a.origin_slot = sl.idx
WHERE {_NOT_AIMED_HERE}
UNION ALL
SELECT
    sl.run_id,
    sl.step,
    sl.idx,
    sl.status,
    a.id,
    CASE WHEN a.slot_idx IS NULL THEN 'extra_in' ELSE 'borrowed_in' END,
    1,{_ATTEMPT_COLUMNS}
FROM slots sl
JOIN attempts a ON a.id = sl.group_attempt_id AND a.run_id = sl.run_id
WHERE {_NOT_AIMED_HERE} AND {_NOT_FROM_HERE}
"""

#: Per slot: the dynamic-sampling (filter) budget and the fault-tolerance (drop) budget, used
#: and left. The two never share a counter (SPEC §3.3).
BUDGET_USE = """
CREATE VIEW budget_use AS
SELECT
    sl.run_id,
    sl.step,
    sl.idx AS slot_idx,
    sl.status,
    sl.shrink_reason,
    sl.filtered,
    sl.filter_replacements,
    sl.filter_budget,
    sl.filter_budget - sl.filter_replacements AS filter_budget_left,
    CASE WHEN sl.filter_budget > 0
        THEN CAST(sl.filter_replacements AS FLOAT) / sl.filter_budget END AS filter_budget_used,
    sl.infra_failures,
    sl.data_failures,
    sl.drops,
    sl.drop_replacements,
    sl.drop_budget,
    sl.drop_budget - sl.drop_replacements AS drop_budget_left,
    CASE WHEN sl.drop_budget > 0
        THEN CAST(sl.drop_replacements AS FLOAT) / sl.drop_budget END AS drop_budget_used,
    sl.borrowed_in,
    sl.lent_out,
    sl.attempts
FROM slots sl
"""

#: Per step (the step an attempt serves): how many finished groups were zero-variance and how
#: many the filter threw away. A run whose filter_rate is 0 while zero_variance is not, with
#: dynamic sampling on, has a filter that never fires.
FILTER_RATE = """
CREATE VIEW filter_rate AS
SELECT
    a.run_id,
    a.step,
    COUNT(*) AS attempts,
    SUM(CASE WHEN a.zero_variance IS NOT NULL THEN 1 ELSE 0 END) AS finished,
    SUM(CASE WHEN a.zero_variance THEN 1 ELSE 0 END) AS zero_variance,
    SUM(CASE WHEN a.state = 'filtered' THEN 1 ELSE 0 END) AS filtered,
    SUM(CASE WHEN a.state = 'committed' THEN 1 ELSE 0 END) AS committed,
    SUM(CASE WHEN a.state = 'failed' THEN 1 ELSE 0 END) AS failed,
    CASE WHEN SUM(CASE WHEN a.zero_variance IS NOT NULL THEN 1 ELSE 0 END) > 0
        THEN CAST(SUM(CASE WHEN a.zero_variance THEN 1 ELSE 0 END) AS FLOAT)
            / SUM(CASE WHEN a.zero_variance IS NOT NULL THEN 1 ELSE 0 END)
        END AS zero_variance_fraction,
    CASE WHEN SUM(CASE WHEN a.zero_variance IS NOT NULL THEN 1 ELSE 0 END) > 0
        THEN CAST(SUM(CASE WHEN a.state = 'filtered' THEN 1 ELSE 0 END) AS FLOAT)
            / SUM(CASE WHEN a.zero_variance IS NOT NULL THEN 1 ELSE 0 END)
        END AS filter_rate
FROM attempts a
GROUP BY a.run_id, a.step
"""

#: name -> CREATE statement, in creation order (dropped in reverse).
VIEWS: dict[str, str] = {
    "step_summary": STEP_SUMMARY,
    "slot_history": SLOT_HISTORY,
    "budget_use": BUDGET_USE,
    "filter_rate": FILTER_RATE,
}


def upgrade() -> None:
    for sql in VIEWS.values():
        op.execute(sql)


def downgrade() -> None:
    for name in reversed(VIEWS):
        op.execute(f"DROP VIEW IF EXISTS {name}")

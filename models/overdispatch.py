"""Adaptive over-dispatch: keep enough attempts in flight that a step fills in about one
generation latency, without generating groups that can never train.

With `N` open slots and zero-variance fraction `p`, one attempt per slot yields about
`N(1 - p)` usable groups, and a slot whose group is filtered waits a whole generation for its
replacement. So a step carries EXTRA attempts — ones that serve the step rather than one slot —
sized so that the live attempts' expected usable groups cover its open slots with
`async_rl.over_dispatch.safety_sigmas` standard deviations of margin (`decisions.extra_attempts`,
with `p` estimated online from the run's finished groups). An extra that commits fills the
earliest open slot it may (that slot's own attempt becomes an extra in turn); one that finds
no open slot is parked and lent to a slot whose group is filtered, never discarded.

What bounds the waste (measured with `python -m bench fill`, see bench/README.md): a group
trains at most `max_lookahead_versions` versions after the weights that generated it, and step
`s` is admitted when version `s - lookahead` is published, so an attempt that starts while `s`
is the newest admitted step can serve steps up to `s` only. Whatever such attempts return after
`s` is released is lost. Hence:

- **only the newest admitted step gets extras.** An older step's filtered slots borrow groups
  committed for the steps admitted after it (those attempts are in flight anyway, and their
  lenders get fresh attempts with newer weights): borrowing is free over-dispatch. Extras for
  an older step would be generated with weights too old for any step after it.
- **an extra does not displace an attempt that is generating with weights too old for a later
  step** (`displaceable`): the displaced attempt would come back after its step filled and be
  lost. Only a step's last open slots (`async_rl.over_dispatch.tail_fraction` of its slots, at
  least one) may take a group that displaces one: that trims the slowest stragglers of each
  step for a bounded loss.
- **unstarted extras of a step that was released move to the newest open step**
  (`reaim_stranded_extras`): they will start with the newest weights and count there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from sqlalchemy import and_, bindparam, case, or_, select, update

from refill.models import decisions, driver, sql
from refill.models.context import GROUP_COLUMNS, SLOT_COLUMNS, RunContext
from refill.models.dataloader import mark_taken, take_spare
from refill.models.metrics import zero_variance_from_counters
from refill.models.rows import AttemptRow, GroupRow, Read, SlotRow
from refill.models.samplers import SlotView
from refill.models.slots import LIVE, dispatch, fill, place, placement_candidates, release_to_extra
from refill.models.sql import literal_in
from refill.models.tables import (
    Attempt,
    AttemptReason,
    AttemptState,
    Group,
    Slot,
    SlotStatus,
    Step,
    StepStatus,
)

_RUNNING = AttemptState.RUNNING.value
# Tables, not ORM classes, in the per-batch queries (see context.py).
_attempts, _groups, _slots, _steps = Attempt.__table__, Group.__table__, Slot.__table__, Step.__table__
_UNSTARTED = (AttemptState.PENDING.value, AttemptState.QUEUED.value)


def zero_variance_estimate(ctx: RunContext) -> decisions.ZeroVarianceEstimate:
    zero, total = zero_variance_from_counters(ctx)
    return decisions.ZeroVarianceEstimate(zero, total)


@dataclass(frozen=True)
class Counted:
    """`top_up`'s counts read with a batch's other reads (`counts_read`), before the batch
    changed anything: good for `top_up` while nothing was written since (`RowStore.writes`)."""

    step: int
    bound: int
    writes: int
    live: int
    parked: int


def counts_read(ctx: RunContext) -> Read | None:
    """`top_up`'s counts as a read that can join a batch's first read-ahead (one round trip
    fewer a batch), or None where `top_up` counts nothing. Its one row goes to `counted`."""
    if not _dispatching(ctx) or not ctx.run.next_step:
        return None
    step = ctx.run.next_step - 1
    # Late: counting the step's live attempts walks thousands of index entries (most of the
    # joint read's time on the server), while this process reads the batch's other rows.
    return Read(None, sql.dispatch_counts(ctx.run.id, step, step - ctx.settings.max_lookahead_versions), extra=("live", "parked"), late=True)


def counted(ctx: RunContext, read: Read, found: list[tuple[int, int]]) -> Counted:
    """What `read` (from `counts_read`) found, as `top_up` takes it, stamped with how many
    times the batch had written rows when it was read."""
    params = read.query.params
    [(live, parked)] = found
    return Counted(params["newest_step"], params["parked_bound"], ctx.rows.writes, int(live or 0), int(parked or 0))


def _dispatching(ctx: RunContext) -> bool:
    """Whether `top_up` sends extras at all in this run now."""
    settings = ctx.settings
    return settings.over_dispatch and settings.use_dynamic_sampling and ctx.running


def top_up(ctx: RunContext, ahead: Counted | None = None) -> int:
    """Dispatch the extras the newest admitted step needs now; returns how many were sent.
    `ahead`: its counts, if read ahead with the batch (`counts_read`)."""
    settings = ctx.settings
    if not _dispatching(ctx):
        return 0
    newest = ctx.find_step(ctx.run.next_step - 1) if ctx.run.next_step else None
    p = zero_variance_estimate(ctx).p
    fill_tails_from_parked(ctx)
    reaim_if_steps_changed(ctx)
    if newest is None or newest.status != StepStatus.OPEN.value:
        return 0
    # The step's live attempts, and the parked groups it may borrow (supply already
    # committed): counted in the database as it was before this batch, plus what the batch
    # changed and has not written yet. Writing it first, for these counts alone, cost every
    # batch a second round of writes (the extras dispatched below are written with the rest);
    # read with the batch's other reads (`ahead`) while nothing was written since, they cost
    # it no round trip of their own.
    bound = newest.step - settings.max_lookahead_versions
    if ahead is not None and (ahead.step, ahead.bound, ahead.writes) == (newest.step, bound, ctx.rows.writes):
        live, parked = ahead.live, ahead.parked
    else:
        live, parked = ctx.session.execute(*sql.dispatch_counts(ctx.run.id, newest.step, bound)).one()
    live = int(live or 0) + ctx.rows.unwritten_change(
        AttemptRow, lambda row: row["state"] in LIVE and row["step"] == newest.step
    )
    parked = int(parked or 0) + ctx.rows.unwritten_change(
        GroupRow, lambda row: bool(row["parked"]) and row["weight_version"] >= bound
    )
    need = newest.num_slots - newest.shrunk - newest.committed - parked
    cap = math.floor(settings.over_dispatch_max_fraction * newest.num_slots) - newest.extras
    sigmas = settings.over_dispatch_sigmas
    if settings.max_lookahead_versions >= 1:
        # The steps admitted after this one lend it their committed groups (their attempts are
        # in flight anyway), so a shortfall is covered by borrowing, while a surplus can only
        # be carried `max_lookahead_versions` steps. The margin is taken below the expected
        # need: a few slots borrow rather than many groups expire unused.
        sigmas = -sigmas
    add = decisions.extra_attempts(need, live, p, sigmas, max(0, cap))
    ctx.reserve_spares(add)
    sent = 0
    for _ in range(add):
        spare = take_spare(ctx)
        if spare is None:
            break
        mark_taken(spare, dispatch(ctx, step=newest.step, slot=None, prompt_id=spare.prompt_id, reason=AttemptReason.EXTRA))
        newest.extras += 1
        sent += 1
    return sent


def steps_between(open_steps: Sequence[int]) -> list[tuple[int, int | None]]:
    """The steps that are not in `open_steps` (sorted), as open intervals `(low, high)` with
    `high = None` for no upper end: [2, 3, 6] -> [(-1, 2), (3, 6), (6, None)]."""
    bounds: list[int | None] = [-1, *open_steps, None]
    return [
        (low, high)
        for low, high in pairwise(bounds)
        if low is not None and (high is None or high > low + 1)
    ]


def reaim_if_steps_changed(ctx: RunContext) -> int:
    """`reaim_stranded_extras` (after a flush) if a step opened or left 'open' in this
    transaction: only then can an unstarted extra be left on a step that no longer takes
    groups, or a step be there to take it, since every transaction that opens or releases a
    step calls this (a batch of results and admission through `top_up`, the reaper)."""
    settings = ctx.settings
    if not (ctx.steps_changed and settings.over_dispatch and settings.use_dynamic_sampling and ctx.running):
        return 0
    ctx.flush()
    ctx.steps_changed = False
    return reaim_stranded_extras(ctx)


def reaim_stranded_extras(ctx: RunContext) -> int:
    """Move the unstarted extras of steps that are no longer open to the newest open step (with
    that step's staleness floor); returns how many moved. Call after a flush."""
    open_steps = [row.step for row in ctx.open_steps()]
    if not open_steps:
        return 0
    target = open_steps[-1]
    floor = max(0, target - ctx.settings.max_lookahead_versions)
    # "Not an open step", spelled as the ranges between the open steps: index ranges that
    # reach only extras of settled steps. (Thousands of extras can be queued for the open
    # steps; `step IN (settled steps)` read every one of them on every batch.)
    settled = [
        and_(_attempts.c.step > low, _attempts.c.step < high) if high is not None else _attempts.c.step > low
        for low, high in steps_between(open_steps)
    ]
    attempts = _attempts
    stranded = sql.attempts_locked_by_id(
        "stranded",
        attempts.c.run_id == ctx.run.id,
        attempts.c.slot_idx.is_(None),
        literal_in(attempts.c.state, _UNSTARTED),
        or_(*settled),
    )
    moved = ctx.session.execute(
        update(attempts)
        .where(attempts.c.id == stranded.c.id)
        .values(
            step=target,
            min_weight_version=case(
                (attempts.c.min_weight_version < floor, floor), else_=attempts.c.min_weight_version
            ),
        )
        .returning(attempts.c.id, attempts.c.min_weight_version)
    ).all()
    for attempt_id, min_weight_version in moved:
        ctx.rows.patched(AttemptRow, attempt_id, step=target, min_weight_version=min_weight_version)
    return len(moved)


def tail_slots(num_slots: int, fraction: float) -> int:
    """How many open slots a step has left when it is in its tail: its slots may then take
    groups that displace attempts generating with old weights (`over_dispatch.tail_fraction`)."""
    return max(1, math.ceil(fraction * num_slots))


def displaceable(ctx: RunContext, candidates: Sequence[SlotView]) -> list[SlotView]:
    """The candidates (open slots) a group that serves no slot of its own may fill.

    Filling a slot turns the slot's live attempt into an extra of the step. Left out are slots
    whose live attempt is generating with weights too old for any later step (`min_weight_version
    + max_lookahead_versions <= step`): it would most likely come back after the step filled,
    when no slot it may fill is open, and be lost. The exception is a step in its tail (see
    `tail_slots`), which should not wait on its slowest generations.
    """
    if not candidates:
        return []
    old = _running_with_old_weights(ctx)
    if not old:
        return list(candidates)  # no attempt generates with weights too old: nothing blocks
    tail: dict[int, bool] = {}
    blocked: set[tuple[int, int]] = set()
    for view in candidates:
        key = (view.step, view.idx)
        if view.step not in tail:
            step = ctx.step(view.step)
            tail[view.step] = step.num_slots - step.committed - step.shrunk <= tail_slots(
                step.num_slots, ctx.settings.over_dispatch_tail_fraction
            )
        attempt_id = old.get(key)
        if attempt_id is None or tail[view.step] or ctx.handing_over(key):
            continue
        # An attempt that finished, moved or was handed over in this transaction no longer
        # blocks its slot.
        row = ctx.rows.attempts.get(attempt_id)
        if row is not None and (row.state != _RUNNING or (row.step, row.slot_idx) != key):
            continue
        blocked.add(key)
    return [v for v in candidates if (v.step, v.idx) not in blocked]


def place_extra(ctx: RunContext, group: GroupRow) -> SlotRow | None:
    """Place a group that serves no slot of its own (an extra's): in any open slot it may
    fill, but not one whose attempt would most likely come back too late to be trained
    (`displaceable`); None when it is parked."""
    return place(ctx, group, None, displaceable(ctx, placement_candidates(ctx, group, None)))


def _running_with_old_weights(ctx: RunContext) -> dict[tuple[int, int], int]:
    """Slot -> its running attempt, for attempts generating with weights too old for any step
    after theirs (`min_weight_version + max_lookahead_versions <= step`). Read once per
    transaction: a batch places hundreds of extras, and attempts that start meanwhile (in the
    workers' transactions) are the ones a snapshot may miss, which only makes a slot eligible."""
    if ctx.old_running is None:
        params = {"run_id": ctx.run.id, "lookahead": ctx.settings.max_lookahead_versions}
        ctx.old_running = {(step, idx): attempt_id for attempt_id, step, idx in driver.rows(ctx.session, _OLD_RUNNING, params)}
    return ctx.old_running


# The per-batch statements below, built once (see `sql.Query`).
_OLD_RUNNING = select(_attempts.c.id, _attempts.c.step, _attempts.c.slot_idx).where(
    _attempts.c.run_id == bindparam("run_id"),
    _attempts.c.state == _RUNNING,
    _attempts.c.slot_idx.is_not(None),
    _attempts.c.min_weight_version + bindparam("lookahead") <= _attempts.c.step,
)
_PARKED_FOR_STEP = (
    select(*GROUP_COLUMNS)
    .where(
        _groups.c.run_id == bindparam("run_id"),
        _groups.c.parked.is_(True),
        _groups.c.weight_version >= bindparam("oldest"),
        _groups.c.weight_version <= bindparam("step"),
    )
    .order_by(_groups.c.weight_version, _groups.c.attempt_id)
    .limit(bindparam("limit"))
)
_OPEN_OF_STEP = (
    select(*SLOT_COLUMNS)
    .where(_slots.c.run_id == bindparam("run_id"), _slots.c.step == bindparam("step"), _slots.c.status == SlotStatus.OPEN.value)
    .order_by(_slots.c.needs_replacement.desc(), _slots.c.idx)
    .limit(bindparam("limit"))
)


def fill_tails_from_parked(ctx: RunContext) -> int:
    """Fill the open slots of steps in their tail with parked groups they may train (oldest
    weights first), their live attempts becoming extras; returns how many were filled.

    A parked group is surplus that no filtered slot has borrowed yet; at the release of the
    last step its weights may train in, it is lost. A step's last slots wait on its slowest
    generations: filling them with parked groups releases the step sooner at no extra loss.
    """
    filled = 0
    lookahead = ctx.settings.max_lookahead_versions
    flushed = False
    for step in ctx.open_steps():
        open_count = step.num_slots - step.committed - step.shrunk
        if not 0 < open_count <= tail_slots(step.num_slots, ctx.settings.over_dispatch_tail_fraction):
            continue
        if not flushed:
            # The queries below see the groups this transaction parked and the slots it settled.
            ctx.flush()
            flushed = True
        groups = ctx.rows.load(
            GroupRow, sql.Query(_PARKED_FOR_STEP, {"run_id": ctx.run.id, "oldest": step.step - lookahead, "step": step.step, "limit": open_count})
        )
        # Placed by an earlier step of this loop, not written yet: not parked any more.
        groups = [group for group in groups if group.parked]
        if not groups:
            continue
        slots = ctx.rows.load(SlotRow, sql.Query(_OPEN_OF_STEP, {"run_id": ctx.run.id, "step": step.step, "limit": len(groups)}))
        for slot, group in zip(slots, groups, strict=False):
            if step.status != StepStatus.OPEN.value:
                break
            release_to_extra(ctx, slot)
            fill(ctx, slot, group, moved=True)
            filled += 1
    return filled

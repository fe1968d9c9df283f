"""Adaptive over-dispatch: keep enough attempts in flight that a step fills in about one
generation latency.

With `N` open slots and zero-variance fraction `p`, one attempt per slot yields about
`N(1 - p)` usable groups, and a slot whose group is filtered waits a whole generation for its
replacement. So each open step carries EXTRA attempts — ones that serve the step rather than
one slot — sized so that the live attempts' expected usable groups cover its open slots with
`async_rl.over_dispatch.safety_sigmas` standard deviations of margin (`decisions.extra_attempts`,
with `p` estimated online from the run's finished groups). An extra that commits fills the
earliest open slot it may (that slot's own attempt becomes an extra in turn); one that finds
no open slot is parked and lent to a later step within the staleness bound, never discarded.
"""

from __future__ import annotations

import math

from sqlalchemy import func, select

from refill.models import decisions
from refill.models.context import RunContext
from refill.models.dataloader import take_spare
from refill.models.slots import LIVE, dispatch, measured_zero_variance
from refill.models.tables import Attempt, AttemptReason, Step, StepStatus


def zero_variance_estimate(ctx: RunContext) -> decisions.ZeroVarianceEstimate:
    zero, total = measured_zero_variance(ctx)
    return decisions.ZeroVarianceEstimate(zero, total)


def top_up(ctx: RunContext, steps: list[Step] | None = None) -> int:
    """Dispatch the extras each open step needs now; returns how many were sent."""
    settings = ctx.settings
    if not settings.over_dispatch or not settings.use_dynamic_sampling or not ctx.running:
        return 0
    if steps is None:
        steps = [s for s in ctx.pinned if isinstance(s, Step)]
    steps = sorted(
        {s.step: s for s in steps if s.status == StepStatus.OPEN.value}.values(), key=lambda s: s.step
    )
    if not steps:
        return 0
    p = zero_variance_estimate(ctx).p  # flushes: the count below sees this transaction's attempts
    live = dict(
        ctx.session.execute(
            select(Attempt.step, func.count())
            .where(
                Attempt.run_id == ctx.run.id,
                Attempt.state.in_(LIVE),
                Attempt.step.in_([s.step for s in steps]),
            )
            .group_by(Attempt.step)
        ).all()
    )
    sent = 0
    for step in steps:
        need = step.num_slots - step.shrunk - step.committed
        cap = math.floor(settings.over_dispatch_max_fraction * step.num_slots) - step.extras
        add = decisions.extra_attempts(need, int(live.get(step.step, 0)), p, settings.over_dispatch_sigmas, max(0, cap))
        for _ in range(add):
            spare = take_spare(ctx)
            if spare is None:
                return sent
            spare.taken_by = dispatch(ctx, step=step.step, slot=None, prompt_id=spare.prompt_id, reason=AttemptReason.EXTRA)
            step.extras += 1
            sent += 1
    return sent

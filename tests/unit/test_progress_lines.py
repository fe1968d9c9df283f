"""The per-step lines of `refill run start` off a terminal (a log): one for every step."""

from __future__ import annotations

from rich.console import Console

from refill.admin.progress import RunDisplay, StepLines
from refill.admin.progress_queries import RunProgress


def snapshot(*steps: int) -> RunProgress:
    """A controller's progress snapshot carrying the metrics of `steps` (its newest trained)."""
    return RunProgress(
        run_id=3,
        name="r",
        status="running",
        end_reason=None,
        error=None,
        max_num_steps=99,
        trained_steps=len(steps),
        weight_version=len(steps),
        spare_pool=0,
        recent_metrics=[
            {"step": s, "reward": 0.5, "first_attempt_reward": 0.25, "zero_variance_fraction": 0.125, "filtered_groups": 2, "step_fill_seconds": 1.0}
            for s in steps
        ],
    )


def steps_of(lines: list[str]) -> list[str]:
    return [line.split(":")[0] for line in lines]


def test_every_step_has_one_line_in_order_though_several_trained_between_snapshots() -> None:
    lines = StepLines()
    assert lines.lines(snapshot()) == []
    # The line `refill tail` prints too; what the step has not got (here: most of it) is `-`.
    assert lines.lines(snapshot(0)) == [
        "step 0: reward 0.500 (unfiltered -, first-attempt 0.250, zero-var 0.12, filtered 2, fill 1.00s, "
        "rollouts/group -, tokens/group -, skipped -)"
    ]
    # Two steps trained between snapshots: both get their line (the newest alone did before).
    assert steps_of(lines.lines(snapshot(0, 1, 2))) == ["step 1", "step 2"]
    assert lines.lines(snapshot(0, 1, 2)) == []
    assert steps_of(lines.lines(snapshot(1, 2, 3))) == ["step 3"]


def test_more_steps_between_snapshots_than_one_carries_are_said_not_skipped() -> None:
    lines = StepLines()
    lines.lines(snapshot(0))
    out = lines.lines(snapshot(*range(20, 36)))
    assert out[0] == "steps 1-19: trained (`refill metrics 3` has their metrics)"
    assert steps_of(out[1:]) == [f"step {s}" for s in range(20, 36)]


def test_a_resumed_run_starts_with_the_lines_of_its_newest_steps() -> None:
    assert steps_of(StepLines().lines(snapshot(40, 41))) == ["step 40", "step 41"]


def test_the_live_display_keeps_the_newest_steps_rows_only() -> None:
    display = RunDisplay(Console(), recent=4, enabled=False)
    display.update(snapshot(0, 1, 2))
    display.update(snapshot(*range(3, 19)))
    assert sorted(display.rows) == [15, 16, 17, 18]

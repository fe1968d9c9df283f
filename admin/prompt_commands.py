"""`refill prompts RUN [--skipped] [--json]`: each prompt's history in a run, the numbers
pre-rollout skipping (`data.prompt_skipping`) decides by: attempts, the zero-variance streak
(all-solved and all-failed apart), the last pass rate, what the loader did the last time it
reached the prompt, and when it was last seen."""

from __future__ import annotations

from typing import Annotated

import typer

from refill.admin.console import note, print_json, print_table
from refill.admin.inspect_common import AsJson, DatabaseUrl, RunId, jsonable, read


def prompts(
    run_id: RunId,
    skipped: Annotated[
        bool, typer.Option("--skipped", help="Only the prompts the loader skipped the last time it reached them.")
    ] = False,
    database_url: DatabaseUrl = None,
    as_json: AsJson = False,
) -> None:
    """Show each prompt's history: attempts, zero-variance streak, last pass rate, skip state.

    The streak counts the prompt's latest groups that were all solved (or all failed); under
    data.prompt_skipping it makes the skip probability 1 - max(rate**streak, min_exploration).
    The same numbers are the `prompt_history` view's."""
    from refill.admin.prompt_queries import prompt_history, skipping_summary

    def question(session):  # type: ignore[no-untyped-def]
        return skipping_summary(session, run_id), prompt_history(session, run_id, skipped_only=skipped)

    summary, rows = read(database_url, question)
    if as_json:
        print_json(jsonable({"run_id": run_id, "skipping": summary, "prompts": rows}))
        return
    if summary["enabled"]:
        note(
            f"run {run_id}: skipping on; the loader reached {summary['draws']} places and skipped "
            f"{summary['skipped']}; exploration rate {summary['exploration_solved']:.3f} (all solved), "
            f"{summary['exploration_failed']:.3f} (all failed), floor {summary['min_exploration']}"
        )
    else:
        note(f"run {run_id}: skipping off (data.prompt_skipping.enabled); the history is what it would read")
    if not rows:
        note(f"run {run_id}: no {'skipped ' if skipped else ''}prompts")
        return
    print_table(
        [
            {
                "prompt": r["prompt_key"],
                "attempts": r["attempts"],
                "scored": r["scored"],
                "zero-var": r["zero_variance_groups"],
                "last pass": r["last_pass_rate"],
                "streak": f"{r['zero_variance_streak']} {r['streak_kind']}" if r["streak_kind"] else "0",
                "skip": r["skip_state"],
                "p(skip)": r["last_skip_probability"],
                "skips": r["skips"],
                "last step": r["last_seen_step"],
                "last epoch": r["last_seen_epoch"],
            }
            for r in rows
        ],
        title=f"run {run_id}: prompts{' skipped at their last draw' if skipped else ''}",
    )

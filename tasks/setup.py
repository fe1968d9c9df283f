"""From a config file to a run in the ledger: validate, load the data, prepare weight
version 0, record it all. Nothing is dispatched until a controller starts the run."""

from __future__ import annotations

import logging
from pathlib import Path

from refill.config import RunConfig
from refill.models.dataset import data_source_fingerprint, load_dataset
from refill.models.db import Ledger
from refill.models.migrate import upgrade
from refill.models.runs import PromptRow, create_run, publish_initial_weights

log = logging.getLogger(__name__)


def format_prompt(template: str, row: dict) -> str:
    return template.format(**row)


def create_run_from_config(ledger: Ledger, config: RunConfig, *, migrate: bool = True) -> int:
    """Record a new run for `config`; returns its id. Weight version 0 is prepared here (the
    warm start of the tiny model runs now, once, and is cached)."""
    if migrate:
        upgrade(ledger.engine)
    rows = load_dataset(config)
    prompts = [PromptRow(text=format_prompt(config.data.prompt_template, row), row=row) for row in rows]
    snapshot = config.snapshot()

    def create(session) -> tuple[int, str]:  # type: ignore[no-untyped-def]
        run = create_run(
            session,
            name=config.run.name or "run",
            config=snapshot,
            config_hash=config.config_hash(),
            prompts=prompts,
            data_fingerprint=data_source_fingerprint(rows),
            output_dir=str(Path(config.run.output_dir).resolve()),
        )
        session.flush()
        return run.id, run.run_dir

    run_id, run_dir = ledger.transaction(create, what="create run")
    path = initial_weights(config, run_dir)
    ledger.transaction(lambda s: publish_initial_weights(s, run_id, path), what="publish v0")
    log.info("created run %s in %s", run_id, run_dir)
    return run_id


def initial_weights(config: RunConfig, run_dir: str) -> str | None:
    """Where generation workers find weight version 0 (None: nothing to load, e.g. `sim`)."""
    if config.infra.trainer == "null" and config.generation.backend == "sim":
        return None
    from refill.trainer.warmstart import prepare_initial_weights

    return prepare_initial_weights(config, run_dir)

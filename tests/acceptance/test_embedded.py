"""The embedded default runs the same tasks, consumer and ledger code in one process: worker
threads on kombu's in-process transport and a SQLite ledger."""

from __future__ import annotations

from refill.config import config_from_dict
from refill.tasks.controller import Controller
from refill.tasks.embedded import embedded_fleet
from refill.tasks.setup import create_run_from_config
from tests.acceptance.runs import assert_healthy_dynamic_sampling_run, run_facts
from tests.support.fleet import SIM_CONFIG, merged


def test_twenty_step_run_embedded(tmp_path) -> None:
    raw = merged(SIM_CONFIG, {"run": {"output_dir": str(tmp_path)}})
    config = config_from_dict(raw, name="embedded")
    with embedded_fleet(f"sqlite:///{tmp_path}/refill.db") as runtime:
        run_id = create_run_from_config(runtime.ledger, config)
        controller = Controller(runtime.ledger, runtime.app, run_id)
        controller.start()
        assert controller.run(max_seconds=180) == "completed"
        with runtime.ledger.session() as session:
            facts = run_facts(session, run_id)
    assert_healthy_dynamic_sampling_run(facts, steps=20, n_prompts=16, lookahead=1)
    assert facts.borrowed_in > 0

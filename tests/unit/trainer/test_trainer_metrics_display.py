"""The trainer's per-step figures reach `refill metrics --trainer`: the ratio, the clip on each
side and the importance weights travel in the step_metrics row's `extra` (every value a float,
as the ledger stores them) and the trainer table shows them."""

from __future__ import annotations

import math

from rich.console import Console

from refill.admin.metrics_commands import TRAINER_COLUMNS, trainer_table

from .test_trainer_grpo import _group, _hand_trainer

#: The columns the ledger's step_metrics row has (models/training.finish_training); the rest
#: of what the trainer reports goes to `extra`.
KNOWN = {"loss", "grad_norm", "clip_fraction", "entropy", "kl", "train_seconds"}


def test_the_trainer_table_shows_the_clip_per_side_and_the_weights(settings, tmp_path):
    # The step of test_the_second_update_of_a_step_clips_on_the_high_side.
    settings.optimizer.groups_per_update = 1
    settings.optimizer.max_grad_norm = 100.0
    settings.grpo.normalize_rewards = False
    trainer = _hand_trainer(settings, tmp_path / "run", [0.0] * 4, lr=2.0)
    uniform = math.log(0.25)
    metrics = trainer.train_step(
        0,
        [_group(1, [2, 3], [1.0, 0.0], [uniform] * 2), _group(2, [2, 1], [1.0, 0.0], [uniform] * 2)],
    )
    extra = {k: float(v) for k, v in metrics.items() if k not in KNOWN}
    shown = {key for key, _, _ in TRAINER_COLUMNS} - {"step", "kl"} - KNOWN
    assert shown <= extra.keys()
    row = {"step": 0, **{k: metrics[k] for k in KNOWN & metrics.keys()}, **extra}
    pending = {"step": 1}  # released, not trained yet

    console = Console(record=True, width=200)
    console.print(trainer_table([row, pending]))
    text = console.export_text()
    for header in ("clip lo", "clip hi", "ratio", "iw", "iw cut", "upd"):
        assert header in text
    cells = [[c.strip() for c in line.split("│")] for line in text.splitlines() if "│" in line]
    trained, untrained = cells
    headers = [header for _, header, _ in TRAINER_COLUMNS]
    shown_row = dict(zip(headers, trained, strict=True))
    # Loss (0 - 0.084996) / 2; 2 updates; ratio (1 + 1 + 1.549822 + 0.940015) / 4; clip lo 0,
    # clip hi 1/4; weights 1, none truncated; no KL term, so no kl.
    assert shown_row == {
        "step": "0", "loss": "-0.0425", "gnorm": shown_row["gnorm"], "upd": "2",
        "ratio": "1.1225", "clip lo": "0.0000", "clip hi": "0.2500", "iw": "1.0000",
        "iw cut": "0.0000", "entropy": "1.386", "kl": "-",
    }
    assert untrained == ["1"] + ["-"] * (len(TRAINER_COLUMNS) - 1)

"""The run's config as tracker parameters (issue 19): secrets hidden with refill.config's
redaction and by key name, everything else as it is; the logging section's checks."""

from __future__ import annotations

import pytest

from refill.config import ConfigError, config_from_dict
from refill.tracking.params import flat_params, redacted


def test_url_passwords_and_secret_keys_are_hidden_and_nothing_else() -> None:
    snapshot = {
        "infra": {"database_url": "postgresql+psycopg://refill:hunter2@db:5432/refill", "broker_url": None},
        "reward": {"kwargs": {"api_key": "sk-123", "hf_token": "hf_abc", "judge_password": "pw", "top_k": 3}},
        "generation": {"max_new_tokens": 16, "sim": {"tokens_per_completion": 8}},
        "data": {"train_path": "https://user:pw@example.invalid/train.jsonl?token=abc&x=1"},
        "optimizer": {"betas": [0.9, 0.999]},
    }
    hidden = redacted(snapshot)
    assert hidden["infra"]["database_url"] == "postgresql+psycopg://refill:***@db:5432/refill"
    assert hidden["reward"]["kwargs"] == {"api_key": "***", "hf_token": "***", "judge_password": "***", "top_k": 3}
    # Words that merely contain a secret's name are not secrets.
    assert hidden["generation"] == {"max_new_tokens": 16, "sim": {"tokens_per_completion": 8}}
    assert hidden["data"]["train_path"] == "https://user:***@example.invalid/train.jsonl?token=***&x=1"
    assert hidden["optimizer"]["betas"] == [0.9, 0.999]
    assert snapshot["reward"]["kwargs"]["api_key"] == "sk-123", "the snapshot itself is left alone"
    flat = flat_params(snapshot)
    assert flat["reward.kwargs.api_key"] == "***" and flat["generation.sim.tokens_per_completion"] == 8
    assert flat["infra.broker_url"] is None
    for secret in ("hunter2", "sk-123", "hf_abc"):
        assert secret not in str(flat)


def test_the_logging_section_defaults_to_nothing_and_checks_its_values() -> None:
    config = config_from_dict({"data": {"builtin": "arith"}}, name="t")
    assert not any(getattr(config.logging, t).enabled for t in ("tensorboard", "wandb", "mlflow"))
    assert config.logging.wandb.mode == "online" and config.logging.mlflow.experiment == "refill"
    with pytest.raises(ConfigError, match=r"logging\.wandb\.mode"):
        config_from_dict({"data": {"builtin": "arith"}, "logging": {"wandb": {"mode": "sometimes"}}}, name="t")
    with pytest.raises(ConfigError, match=r"logging\.mlflow\.tracking_uri: must not hold a password .*MLFLOW_TRACKING_PASSWORD"):
        config_from_dict(
            {"data": {"builtin": "arith"}, "logging": {"mlflow": {"tracking_uri": "https://me:pw@mlflow.example"}}},
            name="t",
        )
    with pytest.raises(ConfigError, match=r"logging\.tensorboard\.colour"):
        config_from_dict({"data": {"builtin": "arith"}, "logging": {"tensorboard": {"colour": "red"}}}, name="t")

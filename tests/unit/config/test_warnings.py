"""Warnings: the run works, but probably not as meant; each says what to set."""

from __future__ import annotations

from refill.config import config_from_dict

from .helpers import build, merged


def test_small_spare_pool_warns_to_cover_one_batch() -> None:
    cfg = build({"grpo": {"num_prompts_per_step": 16}, "rollout_failure": {"replacement_reserve_prompts": 4}})
    [warning] = [w for w in cfg.warnings({}) if "replacement_reserve_prompts" in w]
    assert "set it to at least num_prompts_per_step (16)" in warning.lower()


def test_spare_pool_of_one_batch_does_not_warn() -> None:
    cfg = build({"grpo": {"num_prompts_per_step": 16}, "rollout_failure": {"replacement_reserve_prompts": 16}})
    assert not [w for w in cfg.warnings({}) if "replacement_reserve_prompts" in w]


def test_small_spare_pool_without_dynamic_sampling_does_not_warn() -> None:
    cfg = build({"grpo": {"use_dynamic_sampling": False}, "rollout_failure": {"replacement_reserve_prompts": 1}})
    assert not [w for w in cfg.warnings({}) if "replacement_reserve_prompts" in w]


def test_synchronous_path_knobs_warn_that_they_are_not_read() -> None:
    for knob, value in (("dynamic_sampling_max_gen_batches", 10), ("batch_multiplier", 3.0)):
        cfg = build({"grpo": {knob: value}})
        [warning] = [w for w in cfg.warnings({}) if knob in w]
        assert "does not" in warning and "Remove it" in warning


def test_password_in_file_warns_and_never_reaches_the_snapshot() -> None:
    cfg = build({"infra": {"database_url": "postgresql+psycopg://app:hunter2@db:5432/refill",
                           "broker_url": "redis://:s3cret@redis:6379/0"}})
    warnings = cfg.warnings({})
    assert any(w.startswith("infra.database_url:") and "REFILL_DATABASE_URL" in w for w in warnings)
    assert any(w.startswith("infra.broker_url:") and "REFILL_BROKER_URL" in w for w in warnings)
    assert not any("hunter2" in w or "s3cret" in w for w in warnings)
    snapshot_text = repr(cfg.snapshot())
    assert "hunter2" not in snapshot_text and "s3cret" not in snapshot_text
    # The config object itself keeps the real URL: resolved_urls must still be able to connect.
    assert "hunter2" in cfg.infra.database_url


def test_password_from_the_environment_does_not_warn_but_is_still_hidden() -> None:
    raw = merged({"infra": {"database_url": "${PG_URL}"}})
    cfg = config_from_dict(raw, environ={"PG_URL": "postgresql+psycopg://app:hunter2@db/refill"})
    assert not [w for w in cfg.warnings({}) if "password" in w]
    assert "hunter2" not in repr(cfg.snapshot())


def test_budget_risk_at_a_simulated_drop_rate() -> None:
    cfg = build({"generation": {"backend": "sim", "sim": {"zero_variance_fraction": 0.9}},
                 "infra": {"trainer": "null"},
                 "grpo": {"dynamic_sampling_max_replacements_per_slot": 4, "max_num_steps": 50}})
    [warning] = [w for w in cfg.warnings({}) if "dynamic_sampling_max_replacements_per_slot" in w]
    assert "Raise it to at least" in warning


def test_sqlite_ledger_with_a_network_broker_warns() -> None:
    cfg = build({"infra": {"broker_url": "redis://127.0.0.1:6379/0"}})
    assert any("SQLite" in w for w in cfg.warnings({}))
    assert not any("SQLite" in w for w in cfg.warnings({"REFILL_DATABASE_URL": "postgresql://h/db"}))


def test_knobs_of_other_backends_and_samplers_warn() -> None:
    cfg = build({"generation": {"backend": "hf", "vllm": {"tensor_parallel_size": 2}},
                 "async_rl": {"sampler": {"name": "in_order", "freshest_first": True}}})
    warnings = cfg.warnings({})
    assert any(w.startswith("generation.vllm:") for w in warnings)
    assert any(w.startswith("async_rl.sampler:") for w in warnings)


def test_model_without_weights_and_without_warm_start_warns() -> None:
    # The shipped tiny model is a config and a tokenizer: random weights until warmed up.
    [warning] = build().warnings({})
    assert warning.startswith("model.warm_start.enabled:")
    assert "Set model.warm_start.enabled: true" in warning
    assert build({"model": {"warm_start": {"enabled": True}}}).warnings({}) == []
    assert build({"generation": {"backend": "sim"}, "infra": {"trainer": "null"}}).warnings({}) == []


def test_model_with_weights_does_not_need_a_warm_start(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert build({"model": {"name_or_path": str(tmp_path)}}).warnings({}) == []

"""Every knob has one default, the schema's: each settings object built from a config that sets
no optional key holds exactly the schema's defaults, so a second default (a fallback in a
reader, a dataclass of its own) cannot come back unnoticed. And the snapshot a run stores
comes back through the schema unchanged."""

from __future__ import annotations

import json
from dataclasses import fields
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import BaseModel

from refill.config import ConfigError, RunConfig, config_from_dict, from_snapshot
from refill.config.schema import field_model
from refill.models.settings import KNOBS, LedgerSettings
from refill.tasks.backends.base import engine_config
from refill.tasks.backends.engine_batching import BatchingEngine
from refill.tasks.backends.sim import SimEngine
from refill.tasks.backends.vllm import VLLMEngine
from refill.trainer.settings import read_settings

#: Knobs whose schema default is None and that the schema resolves from another knob.
RESOLVED = {"rollout_failure.replacement_reserve_prompts": "grpo.num_prompts_per_step"}


def schema_default(path: str) -> Any:
    """The default the schema declares for a dotted knob (walking its fields, not a copy)."""
    model: type[BaseModel] = RunConfig
    *sections, name = path.split(".")
    for section in sections:
        sub = field_model(model.model_fields[section].annotation)
        assert sub is not None, f"{section} in {path} is not a section"
        model = sub
    if path in RESOLVED and model.model_fields[name].get_default(call_default_factory=True) is None:
        return schema_default(RESOLVED[path])
    return model.model_fields[name].get_default(call_default_factory=True)


def knob_paths(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """Every leaf knob of the schema, dotted."""
    out = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        sub = field_model(info.annotation)
        out += knob_paths(sub, path + ".") if sub is not None else [path]
    return out


def value_at(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


#: What the minimal file sets: the data source, and the run's name (its file's stem).
SET_BY_THE_FILE = {"data.builtin", "run.name"}


@pytest.fixture(params=["file", "old snapshot"])
def minimal(request) -> Any:
    """A config that sets no optional key: as a file would give it (the data source is the one
    key a run needs), or as a snapshot so old it lacks every key."""
    if request.param == "file":
        return config_from_dict({"data": {"builtin": "arith"}}, name="t").snapshot()
    return {}


def field_info(path: str) -> Any:
    model: type[BaseModel] = RunConfig
    *sections, name = path.split(".")
    for section in sections:
        model = field_model(model.model_fields[section].annotation)  # type: ignore[assignment]
    return model.model_fields[name]


def test_every_knob_of_the_schema_has_a_default():
    # A knob without one would make every snapshot stored before it existed fail to load.
    assert len(knob_paths()) > 80
    for path in knob_paths():
        assert not field_info(path).is_required(), path


def test_ledger_settings_are_the_schema_defaults(minimal):
    settings = LedgerSettings.from_config(minimal)
    # Every setting but the sim back-end's vocabulary is a knob, read from the validated config.
    assert {f.name for f in fields(LedgerSettings)} - set(KNOBS) == {"vocab_size"}
    for name, path in KNOBS.items():
        assert getattr(settings, name) == schema_default(path), (name, path)
    assert settings.vocab_size is None  # the default back-end is not sim
    sim = LedgerSettings.from_config({"generation": {"backend": "sim"}})
    assert sim.vocab_size == schema_default("generation.sim.vocab_size")


def test_the_trainer_settings_are_the_schema_defaults(minimal):
    for settings in (read_settings(from_snapshot(minimal)), read_settings(SimpleNamespace())):
        for path in knob_paths():
            if path in SET_BY_THE_FILE:
                continue
            assert value_at(settings, path) == schema_default(path), path


def test_the_back_ends_read_the_schema_defaults(minimal):
    sim = SimEngine.from_config(minimal, virtual=None)
    for attr, path in {
        "alpha": "generation.sim.solve_rate_alpha",
        "beta": "generation.sim.solve_rate_beta",
        "zero_variance_fraction": "generation.sim.zero_variance_fraction",
        "key_field": "generation.sim.key_field",
        "failure_rate": "generation.sim.failure_rate",
        "tokens_per_completion": "generation.sim.tokens_per_completion",
        "vocab_size": "generation.sim.vocab_size",
        "virtual": "generation.sim.virtual",
        "wrong_group_size_rate": "generation.sim.wrong_group_size_rate",
        "oversized_rate": "generation.sim.oversized_rate",
    }.items():
        assert getattr(sim, attr) == schema_default(path), attr
    assert sim.seed == schema_default("run.seed")  # generation.sim.seed unset: the run's seed
    assert sim.oversized_chars == schema_default("infra.max_result_bytes") + 1
    for attr in ("distribution", "mean_seconds", "sigma"):
        assert getattr(sim.latency, attr) == schema_default(f"generation.sim.latency.{attr}")

    args = VLLMEngine.engine_args(minimal)
    for key in ("dtype", "tensor_parallel_size", "gpu_memory_utilization", "enforce_eager"):
        assert args[key] == schema_default(f"generation.vllm.{key}"), key
    assert args["seed"] == schema_default("run.seed")
    assert schema_default("generation.vllm.max_model_len") is None and "max_model_len" not in args

    batching = BatchingEngine.from_config(sim, minimal)
    try:
        assert batching._batcher.max_batch == schema_default("generation.groups_in_flight")
        assert batching._batcher.max_wait_s == pytest.approx(
            schema_default("generation.max_batch_wait_ms") / 1000
        )
    finally:
        batching.close()
    config = engine_config(minimal)
    assert config.generation.hf.device == schema_default("generation.hf.device")
    assert config.generation.backend == schema_default("generation.backend")


def test_the_controller_starts_with_the_schema_intervals():
    from refill.tasks.controller import Controller

    controller = Controller(None, None, 1, "c")  # type: ignore[arg-type]
    assert controller.relay_interval == schema_default("infra.relay_interval_seconds")
    assert controller.housekeeping_interval == schema_default("infra.reaper_interval_seconds")


def changed_config() -> RunConfig:
    """A config that moves many knobs off their defaults."""
    return config_from_dict(
        {
            "run": {"seed": 3},
            "data": {"builtin": "arith", "prompt_key": "question"},
            "model": {"warm_start": {"enabled": True, "steps": 5}},
            "generation": {"backend": "sim", "max_new_tokens": 4, "sim": {"zero_variance_fraction": 0.5}},
            "grpo": {"num_prompts_per_step": 4, "dynamic_sampling_max_replacements_per_slot": 7},
            "loss": {"truncated_importance_sampling_ratio": None},
            "optimizer": {"betas": [0.8, 0.9], "scheduler": "cosine"},
            "async_rl": {"max_lookahead_versions": 2, "sampler": {"name": "windowed", "max_staleness_versions": 1}},
            "rollout_failure": {"on_dropped_prompt": "shrink"},
            "infra": {"trainer": "null", "max_result_bytes": 4096},
        },
        name="changed",
    )


@pytest.mark.parametrize("config", [RunConfig(), changed_config()], ids=["defaults", "changed"])
def test_a_snapshot_round_trips_through_from_snapshot(config):
    for written in (config.model_dump(), config.model_dump(mode="json"), config.snapshot()):
        # As the ledger's JSON column gives it back, too.
        for stored in (written, json.loads(json.dumps(written))):
            rebuilt = from_snapshot(stored)
            assert rebuilt.model_dump() == config.model_dump()
            assert rebuilt.config_hash() == config.config_hash()


def test_an_old_snapshot_gets_the_defaults_of_what_it_lacks():
    snapshot = changed_config().snapshot()
    del snapshot["generation"]["hf"]
    del snapshot["infra"]["max_train_attempts"]
    del snapshot["loss"]
    rebuilt = from_snapshot(snapshot)
    assert rebuilt.generation.hf.device == schema_default("generation.hf.device")
    assert rebuilt.infra.max_train_attempts == schema_default("infra.max_train_attempts")
    assert rebuilt.loss.use_importance_sampling_correction == schema_default(
        "loss.use_importance_sampling_correction"
    )
    assert rebuilt.infra.max_result_bytes == 4096  # what it holds is kept


def test_a_snapshot_the_schema_refuses_names_the_key():
    with pytest.raises(ConfigError, match=r"grpo.num_prompts_per_step: must be at least 1") as caught:
        from_snapshot({"grpo": {"num_prompts_per_step": 0}}, source="run 7's stored config")
    assert "run 7's stored config" in str(caught.value)
    with pytest.raises(ConfigError, match=r"infra.max_result_byte: unknown key"):
        from_snapshot({"infra": {"max_result_byte": 4096}})
    with pytest.raises(ConfigError, match="must be a mapping of sections"):
        from_snapshot(["grpo"])  # type: ignore[arg-type]


def test_the_embedded_consumer_commits_the_configs_batches(tmp_path) -> None:
    from celery import Celery

    from refill.tasks.embedded import fleet_options
    from refill.tasks.runtime import Runtime

    defaults = fleet_options(from_snapshot({}))
    assert defaults == {
        "generate_concurrency": schema_default("generation.groups_in_flight"),
        "consume_concurrency": schema_default("infra.consumer_batch_size"),
        "consume_wait_ms": schema_default("infra.consumer_batch_wait_ms"),
    }
    # `infra.consumer_batch_wait_ms` was a key nothing read: the consumer waited 20 ms whatever
    # the config said.
    config = from_snapshot({"infra": {"consumer_batch_size": 5, "consumer_batch_wait_ms": 7}})
    options = fleet_options(config)
    runtime = Runtime(
        Celery(), f"sqlite:///{tmp_path}/ledger.db",
        consumer_batch=(options["consume_concurrency"], options["consume_wait_ms"]),
    )
    try:
        batcher = runtime.consumer()._batcher
        assert (batcher.max_batch, batcher.max_wait_s) == (5, pytest.approx(0.007))
    finally:
        runtime.close()

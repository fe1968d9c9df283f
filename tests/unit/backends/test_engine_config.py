"""The back-ends read the real run config (refill.config), not only stand-ins."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from refill.config import ConfigError, RunConfig
from refill.tasks.backends import make_engine
from refill.tasks.backends.base import engine_config
from refill.tasks.backends.engine_batching import BatchingEngine
from refill.tasks.backends.sim import SimEngine


def test_sim_engine_and_batcher_from_a_run_config():
    config = RunConfig.model_validate(
        {
            "run": {"seed": 5},
            "generation": {
                "backend": "sim",
                "groups_in_flight": 4,
                "max_batch_wait_ms": 25,
                "sim": {
                    "zero_variance_fraction": 0.4,
                    "virtual": True,
                    "failure_rate": 0.1,
                    "latency": {"distribution": "lognormal", "mean_seconds": 0.5, "sigma": 0.3},
                },
            },
        }
    )
    engine = make_engine(config)
    assert isinstance(engine, SimEngine)
    assert engine.seed == 5  # generation.sim.seed unset: the run seed
    assert engine.zero_variance_fraction == 0.4 and engine.virtual and engine.failure_rate == 0.1
    assert (engine.latency.distribution, engine.latency.mean_seconds, engine.latency.sigma) == (
        "lognormal",
        0.5,
        0.3,
    )
    batching = BatchingEngine.from_config(engine, config)
    try:
        assert batching._batcher.max_batch == 4
        assert batching._batcher.max_wait_s == pytest.approx(0.025)
    finally:
        batching.close()


def test_engine_config_reads_mappings_objects_and_the_schema_defaults():
    config = RunConfig.model_validate({"generation": {"sim": {"seed": 9}}})
    assert engine_config(config) is config
    assert engine_config(config).generation.sim.seed == 9
    # A knob left unset has the schema's default, its only one (no reader supplies another).
    assert engine_config(config).generation.sim.key_field is None
    assert engine_config({"generation": {"sim": {"seed": 9}}}).generation.sim.seed == 9
    stand_in = SimpleNamespace(generation=SimpleNamespace(sim={"seed": 9}))
    assert engine_config(stand_in).generation.sim.seed == 9
    assert engine_config(config).generation.hf.device == "auto"
    with pytest.raises(ConfigError, match="generation.nothing"):
        engine_config({"generation": {"nothing": 1}})


def test_hf_engine_from_the_default_run_config():
    pytest.importorskip("torch")
    import torch

    torch.set_num_threads(1)
    config = RunConfig.model_validate({"generation": {"backend": "hf", "max_new_tokens": 4}})
    engine = make_engine(config)
    from refill.models.payload import GenerationRequest

    out = engine.generate(
        [
            GenerationRequest(
                attempt_id=1,
                prompt="2+2=",
                row={},
                n=2,
                temperature=1.0,
                top_p=1.0,
                max_new_tokens=4,
                seed=1,
            )
        ]
    )[0]
    assert len(out.completions) == 2

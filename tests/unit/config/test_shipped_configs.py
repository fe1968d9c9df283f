"""The configs in configs/ pass `config check`, and resolve as documented."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refill.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
SHIPPED = ["arith-tiny.yaml", "sim-fleet.yaml", "qwen-math-vllm.yaml"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_is_valid_without_runtime_checks(name: str) -> None:
    cfg = load_config(CONFIGS / name, check_runtime=False, environ={})
    assert cfg.run.name == Path(name).stem
    assert cfg.rollout_failure.replacement_reserve_prompts == cfg.grpo.num_prompts_per_step
    assert cfg.warnings({}) == []


@pytest.mark.parametrize("name", ["arith-tiny.yaml", "sim-fleet.yaml"])
def test_shipped_config_passes_runtime_checks(name: str) -> None:
    cfg = load_config(CONFIGS / name, check_runtime=True, environ={})
    assert cfg.grpo.use_dynamic_sampling


def test_arith_tiny_is_the_embedded_demo() -> None:
    cfg = load_config(CONFIGS / "arith-tiny.yaml", check_runtime=False, environ={})
    assert (cfg.generation.backend, cfg.infra.trainer, cfg.data.builtin) == ("hf", "torch", "arith")
    assert cfg.model.warm_start.enabled
    assert cfg.infra.database_url is None and cfg.infra.broker_url is None
    assert (cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt, cfg.grpo.max_num_steps) == (32, 8, 40)


def test_sim_fleet_uses_passwordless_urls() -> None:
    cfg = load_config(CONFIGS / "sim-fleet.yaml", check_runtime=False, environ={})
    assert cfg.generation.sim.zero_variance_fraction == 0.4
    assert cfg.infra.database_url.startswith("postgresql+psycopg://")
    assert cfg.infra.broker_url.startswith("redis://")
    assert cfg.snapshot()["infra"]["database_url"] == cfg.infra.database_url  # nothing to hide


def test_qwen_template_reports_what_to_set_when_model_and_data_are_absent(tmp_path: Path) -> None:
    env = {"REFILL_MODEL_PATH": str(tmp_path / "no-model"), "REFILL_TRAIN_PATH": str(tmp_path / "no.jsonl")}
    with pytest.raises(ConfigError) as caught:
        load_config(CONFIGS / "qwen-math-vllm.yaml", check_runtime=True, environ=env)
    by_path = {p.path: p for p in caught.value.problems}
    assert set(by_path) == {"model.name_or_path", "data.train_path"}
    assert "REFILL_MODEL_PATH" in by_path["model.name_or_path"].fix
    assert "REFILL_TRAIN_PATH" in by_path["data.train_path"].fix


def test_qwen_template_passes_runtime_checks_once_model_and_data_exist(tmp_path: Path) -> None:
    model = tmp_path / "Qwen2.5-Math-1.5B"
    model.mkdir()
    # The real model's config.json, minus fields that do not affect loading the config.
    (model / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536,
        "intermediate_size": 8960, "num_attention_heads": 12, "num_hidden_layers": 28,
        "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 4096,
    }))
    data = tmp_path / "train.jsonl"
    data.write_text('{"problem": "What is $1+1$?", "answer": "2"}\n'
                    '{"problem": "Solve $x^2=4$ for $x>0$.", "answer": "2"}\n')
    env = {"REFILL_MODEL_PATH": str(model), "REFILL_TRAIN_PATH": str(data)}
    cfg = load_config(CONFIGS / "qwen-math-vllm.yaml", check_runtime=True, environ=env)
    assert cfg.model.name_or_path == str(model)
    assert cfg.generation.backend == "vllm"
    assert cfg.data.prompt_template.endswith("\\boxed{{}}.")

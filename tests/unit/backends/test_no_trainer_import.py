"""A generation worker does not need the trainer's package: its modules, and the model and
weight loading its back-ends do, import nothing from refill.trainer.

Each check runs in a fresh interpreter, since the test session itself imports the trainer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

GENERATION_MODULES = (
    "refill.tasks.generation",
    "refill.tasks.backends",
    "refill.tasks.backends.base",
    "refill.tasks.backends.engine_batching",
    "refill.tasks.backends.sim",
    "refill.tasks.backends.hf",
    "refill.tasks.backends.vllm",
)

TRAINER_MODULES = """
def trainer_modules():
    return sorted(m for m in sys.modules if m == "refill.trainer" or m.startswith("refill.trainer."))
"""

IMPORT_ONLY = f"""
import importlib, json, sys
{TRAINER_MODULES}
for name in {GENERATION_MODULES!r}:
    importlib.import_module(name)
print(json.dumps(trainer_modules()))
"""

# Builds the hf engine from the shipped tiny model, generates, loads a weight version written
# beside it and computes vllm's engine arguments: the loading paths a worker takes at run time.
LOAD_AND_GENERATE = f"""
import json, sys, tempfile
{TRAINER_MODULES}
import torch

torch.set_num_threads(1)
from refill.config import RunConfig
from refill.models.payload import GenerationRequest
from refill.tasks.backends import make_engine
from refill.tasks.backends.vllm import VLLMEngine

config = RunConfig.model_validate(
    {{
        "model": {{"name_or_path": "builtin:tiny-arith"}},
        "generation": {{"backend": "hf", "max_new_tokens": 4, "hf": {{"device": "cpu"}}}},
    }}
)
engine = make_engine(config)
request = GenerationRequest(
    attempt_id=1, prompt="2+2=", row={{}}, n=2, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=1
)
(output,) = engine.generate([request])
assert len(output.completions) == 2, output
with tempfile.TemporaryDirectory() as directory:
    engine.model.save_pretrained(directory)
    engine.load_weights(1, directory)
    assert engine.weight_version == 1
    published = RunConfig.model_validate(
        {{"model": {{"name_or_path": directory}}, "generation": {{"backend": "vllm"}}}}
    )
    # A directory with weights starts vllm from them rather than from dummy weights.
    assert "load_format" not in VLLMEngine.engine_args(published)
print(json.dumps(trainer_modules()))
"""


def _trainer_modules_after(script: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_the_generation_worker_imports_no_trainer_module() -> None:
    assert _trainer_modules_after(IMPORT_ONLY) == []


def test_loading_a_model_and_a_weight_version_imports_no_trainer_module() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    assert _trainer_modules_after(LOAD_AND_GENERATE) == []

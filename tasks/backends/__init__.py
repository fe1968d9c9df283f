"""The generation back-ends (``sim``, ``hf``, ``vllm``) behind the interface of ``base``.

``make_engine`` lives here rather than in ``base`` so that the interface module imports no
back-end: every back-end imports ``base``, and ``base`` imports none of them. The heavy back-ends
(torch, transformers, vllm) are imported only when the configuration asks for them.
"""

from __future__ import annotations

from typing import Any

from refill.tasks.backends.base import Engine, engine_config

BACKENDS = ("sim", "hf", "vllm")


def make_engine(config: Any, **kwargs: Any) -> Engine:
    """Build the engine named by ``generation.backend`` ("sim" | "hf" | "vllm").

    Extra keyword arguments go to the back-end's ``from_config`` (test hooks such as
    ``llm_factory`` for vllm, ``virtual`` for sim).
    """
    config = engine_config(config)
    backend = config.generation.backend
    if backend == "sim":
        from refill.tasks.backends.sim import SimEngine

        return SimEngine.from_config(config, **kwargs)
    if backend == "hf":
        from refill.tasks.backends.hf import HFEngine

        return HFEngine.from_config(config, **kwargs)
    if backend == "vllm":
        from refill.tasks.backends.vllm import VLLMEngine

        return VLLMEngine.from_config(config, **kwargs)
    raise ValueError(f"generation.backend must be one of {', '.join(BACKENDS)}; got {backend!r}")

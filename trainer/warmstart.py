"""Weight version 0: the initial model, optionally after a short supervised warm start.

A randomly initialised model answers no arithmetic question, so every GRPO group would be
zero-variance and dynamic sampling would filter forever. The warm start trains it briefly on
the arithmetic task with cross-entropy on the answer tokens, just enough that sampling at
temperature 1 solves some prompts but not all: the regime where GRPO has signal.

The result depends only on the model config, tokenizer, warm-start settings and the prompt
template, so it is cached under a hash of those and reused by every run that matches.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
from pathlib import Path
from typing import Any

import torch

from refill.data import arith
from refill.model_loading import has_weights, load_model, load_tokenizer, model_directory
from refill.trainer.settings import TrainerConfig, read_settings
from refill.trainer.weights import atomic_directory, copy_tree_atomic, save_model_dir, weights_dir

#: Bump when the warm-start procedure changes, so old cache entries stop matching.
PROCEDURE_VERSION = 1
#: What an untidy warm-start answer ends with before <eos> (exact match counts it wrong).
STRAY_SUFFIX = "."


def cache_root(settings: TrainerConfig) -> Path:
    configured = settings.model.warm_start.cache_dir
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("REFILL_CACHE_DIR")
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "refill"
    return root / "warmstart"


def _file_fingerprint(path: Path) -> str:
    if path.stat().st_size <= 16 << 20:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    # Hashing a multi-GB checkpoint on every start is not worth it; size and mtime identify it.
    stat = path.stat()
    return f"{stat.st_size}:{stat.st_mtime_ns}"


def cache_key(settings: TrainerConfig, source: Path) -> str:
    ws = settings.model.warm_start
    files = {
        p.name: _file_fingerprint(p)
        for p in sorted(source.iterdir())
        if p.is_file() and not p.name.startswith(".")
    }
    material = {
        "procedure": PROCEDURE_VERSION,
        "files": files,
        "steps": ws.steps,
        "lr": ws.lr,
        "batch_size": ws.batch_size,
        "seed": ws.seed,
        "format_noise": ws.format_noise,
        "stray_suffix": STRAY_SUFFIX,
        "prompt_template": settings.data.prompt_template,
        "task": {"name": "arith", "max_operand": arith.DEFAULT_MAX_OPERAND},
    }
    blob = json.dumps(material, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


def warm_start_enabled(settings: TrainerConfig, source: Path) -> bool:
    enabled = settings.model.warm_start.enabled
    return (not has_weights(source)) if enabled is None else bool(enabled)


def _examples(
    rows: list[dict[str, str]], tokenizer: Any, template: str, format_noise: float, seed: int
) -> list[tuple[list[int], list[int]]]:
    eos = tokenizer.eos_token_id
    rng = random.Random(seed)
    out = []
    for row in rows:
        prompt = tokenizer(template.format(**row)).input_ids
        untidy = rng.random() < format_noise
        target = row["answer"] + (STRAY_SUFFIX if untidy else "")
        answer = tokenizer(target, add_special_tokens=False).input_ids + [eos]
        out.append((prompt, answer))
    return out


def supervised_warm_start(model: Any, tokenizer: Any, settings: TrainerConfig) -> list[float]:
    """Train `model` in place on arithmetic rows, loss on the answer and <eos> only.

    Returns the loss of each step. Seeded by `model.warm_start.seed` without touching the
    global RNG streams.
    """
    ws = settings.model.warm_start
    rows = arith.generate(ws.steps * ws.batch_size, seed=ws.seed)
    examples = _examples(rows, tokenizer, settings.data.prompt_template, ws.format_noise, ws.seed)
    pad = tokenizer.pad_token_id
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=ws.lr, weight_decay=0.0)
    # Cosine decay to 10% settles the model at the end instead of leaving it mid-jump.
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda k: 0.1 + 0.45 * (1 + math.cos(math.pi * k / ws.steps)),
    )
    model.train()
    losses = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ws.seed)
        for k in range(ws.steps):
            chunk = examples[k * ws.batch_size : (k + 1) * ws.batch_size]
            width = max(len(p) + len(a) for p, a in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            labels = torch.full((len(chunk), width), -100, dtype=torch.long)
            attention = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, (p, a) in enumerate(chunk):
                ids[row, : len(p) + len(a)] = torch.tensor(p + a)
                labels[row, len(p) : len(p) + len(a)] = torch.tensor(a)
                attention[row, : len(p) + len(a)] = 1
            out = model(
                input_ids=ids.to(device),
                attention_mask=attention.to(device),
                labels=labels.to(device),
            )
            optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(float(out.loss.detach()))
    return losses


def prepare_initial_weights(config: Any, run_dir: str | os.PathLike[str]) -> str:
    """Publish weight version 0 of the run (idempotent) and return its directory.

    With the warm start on, the warm-started model comes from the cache when a matching entry
    exists, and is trained and cached otherwise. With it off, version 0 is the model as
    loaded (pretrained weights, or the seeded random init of a config-only directory).
    """
    settings = read_settings(config)
    final = weights_dir(run_dir, 0)
    if has_weights(final):
        return str(final)
    source = model_directory(settings.model.name_or_path)
    ws = settings.model.warm_start
    if not warm_start_enabled(settings, source):
        model = load_model(source, settings.model.dtype, seed=ws.seed)
        with atomic_directory(final) as tmp:
            save_model_dir(model, load_tokenizer(source), tmp)
        return str(final)

    cached = cache_root(settings) / cache_key(settings, source)
    if not has_weights(cached):
        if ws.steps < 1 or ws.batch_size < 1:
            raise ValueError(
                "model.warm_start.steps and model.warm_start.batch_size must be >= 1 when "
                "the warm start is on; set model.warm_start.enabled: false to skip it"
            )
        tokenizer = load_tokenizer(source)
        model = load_model(source, "float32", seed=ws.seed)
        supervised_warm_start(model, tokenizer, settings)
        with atomic_directory(cached) as tmp:
            save_model_dir(model, tokenizer, tmp)
            (tmp / "warm_start.json").write_text(
                json.dumps({"source": str(source), "settings": vars(ws)}, indent=2, default=str)
            )
    copy_tree_atomic(cached, final)
    return str(final)

"""The policy under FSDP2: built from rank 0's copy, sharded block by block, gathered whole
for publishing.

`fully_shard` is applied to every transformer block (the classes the model lists in
`_no_split_modules`, as Hugging Face's own device maps do) and then to the root, which takes
what is left (embeddings, final norm, head). Only rank 0 reads the weights from disk: the other
ranks build the model on the meta device, so no rank but the first ever holds a whole copy,
and the shards are filled by a broadcast from rank 0. Buffers that are not in the state dict
(rotary frequencies) are broadcast the same way.

Gradients are summed over the ranks, not averaged: each rank's loss is already its share of the
update's loss (divided by the token count over all ranks), so the sum is the single-process
gradient.

Mixed precision, where the device has bf16: parameters all-gathered and computed in bf16,
gradients reduced in fp32, the sharded master weights and the optimizer state in fp32.
Published versions keep `model.dtype`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from refill.model_loading import load_model, quiet_transformers, torch_dtype
from refill.trainer.distributed import World, agreed
from refill.trainer.settings import TrainerConfig


def mixed_precision(settings: TrainerConfig, device: torch.device) -> bool:
    """Whether this trainer computes in bf16 over fp32 master weights
    (`distributed.mixed_precision`: auto = on a GPU that has bf16)."""
    mode = settings.distributed.mixed_precision
    if mode == "off":
        return False
    supported = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if mode == "bf16" and not supported:
        raise ValueError(
            f"distributed.mixed_precision=bf16 needs a GPU with bf16; this trainer runs on "
            f"{device}: use auto (bf16 where the device has it) or off"
        )
    return supported


def master_dtype(settings: TrainerConfig, device: torch.device) -> str:
    """The dtype of the sharded parameters the optimizer updates."""
    return "float32" if mixed_precision(settings, device) else settings.model.dtype


def blocks(model: Any) -> list[torch.nn.Module]:
    """The model's transformer blocks: the modules of the classes it declares unsplittable."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if type(m).__name__ in names]
    if not found:
        # Every rank builds the same model class, so every rank refuses it alike.
        raise agreed(
            ValueError(
                f"{type(model).__name__} declares no transformer block class "
                "(_no_split_modules), so it cannot be sharded block by block; use a Hugging "
                "Face causal LM that does"
            )
        )
    return found


def shard(model: Any, world: World, settings: TrainerConfig, *, frozen: bool = False) -> Any:
    """`fully_shard` per block, then the root; gradients summed over the ranks."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if mixed_precision(settings, world.device):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    units = [*blocks(model), model]  # found before sharding renames their classes
    for block in units[:-1]:
        fully_shard(block, mesh=world.mesh, mp_policy=policy)
    # FSDP keeps the root's parameters (embeddings, head) whole after a forward pass, for the
    # backward pass that follows at once; a frozen model (the KL reference) has none.
    fully_shard(model, mesh=world.mesh, mp_policy=policy, reshard_after_forward=True if frozen else None)
    for unit in units:
        # A factor of 1 turns FSDP's mean into a sum; forcing a plain SUM keeps it off
        # PREMUL_SUM, which gloo lacks.
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return model


def build(path: Path, settings: TrainerConfig, world: World, *, trainable: bool = True) -> Any:
    """The model in `path` (a published weight version), sharded over the world's ranks.
    Every rank calls this together."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    dtype = master_dtype(settings, world.device)
    full: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    model: Any = None
    error: BaseException | None = None
    try:
        if world.leader:
            model = load_model(path, dtype)
            # References, not copies: they outlive the sharding that replaces the parameters.
            full = dict(model.state_dict())
            buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
        else:
            from transformers import AutoConfig, AutoModelForCausalLM

            config = AutoConfig.from_pretrained(str(path), local_files_only=True)
            with torch.device("meta"), quiet_transformers():
                model = AutoModelForCausalLM.from_config(config)
            model = model.to(torch_dtype(dtype))
    except Exception as caught:  # noqa: BLE001 - World.agree raises it on every rank
        error = caught
    world.agree(error, f"loading {path}")
    if trainable and settings.distributed.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not trainable:
        model.requires_grad_(False)
    shard(model, world, settings, frozen=not trainable)
    with world.lockstep("loading the model onto the ranks"):
        model.to_empty(device=world.device)
        set_model_state_dict(
            model,
            full,
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if world.leader:
                    buffer.copy_(buffers[name])
                dist.broadcast(buffer, src=0)
    del full, buffers
    return model.train() if trainable else model.eval()


def gather_full(model: Any, world: World, dtype: str) -> dict[str, torch.Tensor]:
    """The whole state dict on rank 0 (on the CPU, as `dtype`), nothing on the others. Every
    rank calls this together."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    with world.lockstep("gathering the weights to publish"):
        state = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    # A tied parameter (the head sharing the embedding) is saved once, as a single process's
    # save_pretrained saves it: the gathered copies no longer share storage to show it.
    first: dict[int, str] = {}
    tied = set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(parameter), name) != name:
            tied.add(name)
    target = torch_dtype(dtype)
    return {
        name: tensor if target == "auto" else tensor.to(target)
        for name, tensor in state.items()
        if name not in tied
    }


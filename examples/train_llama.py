"""Train a small Llama with FSDP2 (``fully_shard``) the way torchtitan does, on CPU, and checkpoint with DCP.

    .venv/bin/torchrun --nproc-per-node 2 examples/train_llama.py --steps 5 --ckpt-dir /tmp/llama_ckpt

Rank 0 prints the global loss and gradient norm of each step, also as ``float.hex()`` so runs can be compared
bit for bit. The run saves ``<ckpt-dir>/step-<N>`` at the end; a later run with the same ``--ckpt-dir`` resumes
from the newest one, at any world size that divides the global batch (8 sequences).

``--init full`` (default) initializes one full model on rank 0 with the seed and scatters it into the shards,
so every world size starts from the single-device weights. ``--init sharded`` calls ``init_weights()`` on the
sharded parameters as torchtitan does; on CPU that draws every rank's shard from the same RNG state (DTensor's
RNG tracker is CUDA-only), so the rows repeat across ranks and the start depends on the world size.
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from fullshard import fully_shard  # torch FSDP2: from torch.distributed.fsdp import fully_shard
from fullshard.models.llama import Llama, LlamaArgs, build_plain, token_batch


def build_model(mesh, args=None, seed=0, init="full"):
    """A sharded, initialized Llama: meta device → fully_shard per block and root → to_empty → init."""
    args = args or LlamaArgs()
    with torch.device("meta"):
        model = Llama(args)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    if init == "sharded":
        torch.manual_seed(seed)
        model.init_weights()
    else:
        model.init_buffers()  # the rotary table: not in any state dict
        full = build_plain(args, seed).state_dict() if dist.get_rank() == 0 else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, full, options=options)
    return model


def train(model, optimizer, first_step, steps, max_norm=1.0, log=print):
    """``steps`` optimizer steps from global step ``first_step``; returns [(loss, grad_norm)] as floats.

    The loss is the mean over the global batch; the gradient norm is the global one before clipping."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    history = []
    for step in range(first_step, first_step + steps):
        inputs, labels = token_batch(step, rank, world_size)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if isinstance(grad_norm, DTensor):  # the global norm, as a DTensor on the mesh
            grad_norm = grad_norm.full_tensor()
        optimizer.step()
        optimizer.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)  # every rank has the same number of tokens: mean of means
        record = (global_loss.item() / world_size, grad_norm.item())
        history.append(record)
        if rank == 0 and log:
            log(f"step {step + 1:3d}  loss {record[0]:.6f} ({record[0].hex()})  "
                f"grad_norm {record[1]:.6f} ({record[1].hex()})")
    return history


def save_checkpoint(path, model, optimizer, step):
    """Model and optimizer state (sharded DTensors) and the step, in DCP format under ``path``."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)}, checkpoint_id=path)


def load_checkpoint(path, model, optimizer):
    """Load what :func:`save_checkpoint` wrote (at any world size) in place; returns the saved step."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])


def latest_checkpoint(ckpt_dir):
    """The newest ``step-<N>`` folder under ``ckpt_dir``, or None."""
    if not ckpt_dir or not os.path.isdir(ckpt_dir):
        return None
    steps = [int(name.removeprefix("step-")) for name in os.listdir(ckpt_dir) if name.startswith("step-")]
    return os.path.join(ckpt_dir, f"step-{max(steps)}") if steps else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init", choices=("full", "sharded"), default="full")
    parser.add_argument("--ckpt-dir", default=None, help="save here at the end; resume from the newest step-N")
    cli = parser.parse_args()

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build_model(mesh, seed=cli.seed, init=cli.init)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cli.lr, weight_decay=0.1)
    step = 0
    resume = latest_checkpoint(cli.ckpt_dir)
    if resume:
        step = load_checkpoint(resume, model, optimizer)
        if dist.get_rank() == 0:
            print(f"resumed from {resume} (step {step}) at world size {dist.get_world_size()}")
    train(model, optimizer, step, cli.steps)
    if cli.ckpt_dir:
        save_checkpoint(os.path.join(cli.ckpt_dir, f"step-{step + cli.steps}"), model, optimizer, step + cli.steps)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Minimal fullshard training loop; run with
`.venv/bin/torchrun --nproc-per-node 2 examples/minimal.py`."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fullshard import FullyShardedDataParallel as FSDP, ShardingStrategy
from fullshard.models import TransformerBlock, build_model
from fullshard.wrap import ModuleWrapPolicy

dist.init_process_group("gloo")  # "nccl" on GPUs
rank = dist.get_rank()
model = build_model("transformer_lm_gpt_mini", vocab_size=512, max_positions=64, seed=1)
psi = sum(p.numel() for p in model.parameters())
model = FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD,
             auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
local = sum(p.numel() for p in model.parameters())
print(f"rank {rank}: holds {local:,} of {psi:,} parameters; "
      f"embed_tokens.weight shard {tuple(model.embed_tokens.weight.shape)}")
decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                         {"params": no_decay, "weight_decay": 0.0}], lr=1e-3)
g = torch.Generator().manual_seed(rank)
for step in range(5):
    tokens = torch.randint(0, 512, (4, 33), generator=g)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, 512), tokens[:, 1:].reshape(-1))
    loss.backward()
    gnorm = model.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    if rank == 0:
        print(f"step {step}: loss {loss.item():.4f} gnorm {gnorm.item():.4f}")
with model.summon_full_params():
    if rank == 0:
        print("full embed_tokens.weight:", tuple(model.embed_tokens.weight.shape))
dist.destroy_process_group()

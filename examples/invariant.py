"""World-size-invariant training with fully_shard: the same bits at any number of ranks.
Run with `.venv/bin/torchrun --nproc-per-node N examples/invariant.py` for N in 1, 2, 3, 4
(12 micro-batches per update: N must divide 12)."""
import hashlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fullshard import clip_grad_norm_, fully_shard
from fullshard.models import build_model

MICRO, B, T, VOCAB = 12, 2, 32, 512  # global micro-batches per update, sequences each, tokens, vocab
torch.set_num_threads(1)  # CPU kernels' sums depend on the thread count: fix it at every world size
dist.init_process_group("gloo")  # "nccl" on GPUs (then torch.use_deterministic_algorithms(True))
rank, world = dist.get_rank(), dist.get_world_size()
model = build_model("transformer_lm_gpt_mini", vocab_size=VOCAB, max_positions=T, dropout=0.1, seed=1)
for block in model.layers:
    fully_shard(block, world_size_invariant=True)
fully_shard(model, world_size_invariant=True)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
data = torch.randint(0, VOCAB, (4, MICRO, B, T + 1), generator=torch.Generator().manual_seed(0))
for step in range(4):
    losses = torch.zeros(MICRO, dtype=torch.float64)
    for j in range(MICRO // world):
        m = j * world + rank  # rank r's j-th micro-batch is global micro-batch j*W + r
        torch.manual_seed(1000 * step + m)  # dropout masks keyed by the global micro-batch
        tokens = data[step, m]
        logits = model(tokens[:, :-1])
        loss_sum = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), reduction="sum")
        (loss_sum / (MICRO * B * T)).backward()  # normalized by the global token count; ranks' sum
        losses[m] = loss_sum.item()
    dist.all_reduce(losses)  # each entry comes from one rank: the sum adds zeros, in any order
    gnorm = clip_grad_norm_(model.parameters(), 1.0)  # summed exactly: no split-dependent rounding
    opt.step()
    opt.zero_grad()
    if rank == 0:
        loss = sum(losses.tolist()) / (MICRO * B * T)  # summed in global micro-batch order
        print(f"step {step}: loss {loss!r} gnorm {gnorm.item()!r}")
digest = hashlib.sha256()
for _name, param in model.named_parameters():
    digest.update(param.detach().full_tensor().numpy().tobytes())
if rank == 0:
    print(f"{world} ranks: parameters sha256 {digest.hexdigest()[:16]}")
dist.destroy_process_group()

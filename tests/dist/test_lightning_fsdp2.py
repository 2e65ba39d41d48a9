"""PyTorch Lightning's ModelParallelStrategy with ``fully_shard`` on CPU gloo ranks, against one process.

A LightningModule applies ``fully_shard`` per block and at the root in ``configure_model`` on the strategy's
``device_mesh["data_parallel"]``; the Trainer (accelerator="cpu", 2 devices, data_parallel_size=2) trains with
gradient clipping, saves a distributed (DCP) checkpoint and resumes from it. Losses and gradient norms must match
a plain single-process run on the same global batches, and the resumed run must match the uninterrupted one bit
for bit. The ranks are the harness's: Lightning sees LOCAL_RANK set, so it does not launch processes itself,
and it reuses the initialized process group.
"""
from __future__ import annotations

import importlib
import os

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.dist.llama import build_plain, token_batch

lightning = pytest.importorskip("lightning")

# Not in the fast tier (make test-fast): several spawned groups; make test runs it.

IMPLS = {"torch": "torch.distributed.fsdp", "fullshard": "fullshard"}
"""Implementation name → module whose ``fully_shard`` the LightningModule uses (add ``"fullshard"``)."""
LR, STEPS, SPLIT, GLOBAL_BATCH, MAX_NORM = 1e-2, 6, 3, 8, 0.5
"""MAX_NORM is below every step's gradient norm, so clipping acts in every step."""
RTOL, ATOL = 1e-5, 1e-6


def _optimizer(params):
    # eps=1e-6: see tests/dist/test_llama_reference.py (Adam amplifies rounding noise of tiny gradients).
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, eps=1e-6)


def _reference():
    """Single process: per-step (loss, grad norm before clipping) of STEPS steps."""
    model = build_plain()
    opt = _optimizer(model.parameters())
    history = []
    for step in range(STEPS):
        inputs, labels = token_batch(step, global_batch_size=GLOBAL_BATCH)
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        history.append((loss.item(), torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=MAX_NORM).item()))
        opt.step()
        opt.zero_grad()
    return history


def _lightning_run(rank, world, impl, ckpt):
    """Train SPLIT steps and save; resume from the checkpoint for the rest; then STEPS steps uninterrupted.

    Returns this rank's per-step (local loss, global grad norm) of the split and of the uninterrupted run."""
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader

    fully_shard = importlib.import_module(IMPLS[impl]).fully_shard
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # we launched the processes: Lightning must not

    class LitLlama(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, self.history = None, []

        def configure_model(self):
            if self.model is not None:  # Lightning may call it again (fit after fit)
                return
            mesh = self.device_mesh["data_parallel"]
            # A full model with the seed's weights on every rank (Lightning's meta-device path would call
            # reset_parameters per module, which on CPU draws the same values on every shard).
            self.model = build_plain()
            for block in self.model.layers.values():
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def training_step(self, batch, batch_idx):
            # The batch is a function of the global step, not of the loader's position: Lightning gives
            # training loaders a shuffling DistributedSampler, and after resuming from a checkpoint saved
            # when fit() stopped it does not replay the uninterrupted run's order.
            inputs, labels = token_batch(self.global_step, rank, world, GLOBAL_BATCH)
            loss = torch.nn.functional.cross_entropy(self.model(inputs).flatten(0, 1), labels.flatten())
            self.history.append([loss.item()])
            return loss

        def on_before_optimizer_step(self, optimizer):  # before Lightning clips
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.parameters()])
            self.history[-1].append(norm.full_tensor().item())

        def configure_optimizers(self):
            return _optimizer(self.parameters())

    ticks = DataLoader(range(STEPS), batch_size=None)  # one item per step; training_step makes the batch

    def trainer(max_steps):
        return L.Trainer(accelerator="cpu", devices=world, num_nodes=1, max_steps=max_steps,
                         strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
                         gradient_clip_val=MAX_NORM, use_distributed_sampler=False, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=os.path.dirname(ckpt))

    first = LitLlama()
    fit = trainer(SPLIT)
    fit.fit(first, ticks)
    fit.save_checkpoint(ckpt)
    resumed = LitLlama()
    trainer(STEPS).fit(resumed, ticks, ckpt_path=ckpt)
    straight = LitLlama()
    trainer(STEPS).fit(straight, ticks)
    placements = {tuple(p.placements) for p in straight.parameters()}
    return dict(split=first.history + resumed.history, straight=straight.history, placements=str(placements),
                files=sorted(os.listdir(ckpt)))


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_lightning_model_parallel_fsdp2(impl, tmp_path):
    reference = _reference()
    assert min(norm for _, norm in reference) > MAX_NORM, "clipping must act for the test to cover it"
    ranks = run_ranks(_lightning_run, 2, impl, str(tmp_path / "lit.ckpt"), timeout_s=150)
    assert ranks[0]["placements"] == "{(Shard(dim=0),)}", ranks[0]["placements"]
    assert ranks[0]["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"], ranks[0]["files"]

    def global_history(key):  # mean of the ranks' local losses (equal token counts); the norm is global
        return [(sum(r[key][s][0] for r in ranks) / len(ranks), ranks[0][key][s][1]) for s in range(STEPS)]

    assert [len(r["split"]) for r in ranks] == [STEPS] * len(ranks), "the resumed run did not stop at STEPS"
    assert ranks[0]["split"] == ranks[0]["straight"] and ranks[1]["split"] == ranks[1]["straight"], \
        "the run resumed from the checkpoint differs from the uninterrupted one"
    torch.testing.assert_close(torch.tensor(global_history("straight"), dtype=torch.float64),
                               torch.tensor(reference, dtype=torch.float64), rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"Lightning at 2 ranks vs 1 process, (loss, grad norm) per step: {m}")

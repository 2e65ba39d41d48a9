"""Peak RSS growth of one rank while `fullshard train --hf-model` loads a checkpoint, against the full model's bytes.

Saves a random-weight Llama of about 110M parameters (fp32, tied embeddings; 2,048-row MLP, 12 layers of width
768, 32,000 ids) to a temporary directory, then starts 2 gloo ranks on the CPU; each builds the trainer's model
(meta construction, units per decoder layer, its own rows read from the safetensors file: see [Note: sharded
Hugging Face load] in fullshard/train/hf_model.py) and reports its peak RSS growth during that build (VmHWM
after, reset through /proc/self/clear_refs before, minus VmRSS before; file pages of the memory-mapped
safetensors file count as they are touched). With ``--steps N`` the peak also spans N training updates
after the load (batch 2 x 64 tokens per rank), and each rank reports the bytes it all-gathered (an all-gather's
output) and reduce-scattered (a reduce-scatter's input) in each update, from fullshard.core.collectives' counters
as `fullshard bench --lora` counts them; ``--base-dtype bf16`` (with ``--lora-rank``) stores the frozen base in
bf16 beside fp32 adapters; ``--quantize-base nf4`` (with ``--lora-rank``, fsdp-version 2, torchao) stores the
decoder layers' frozen Linear weights as NF4 (QLoRA, fullshard/train/qlora.py).

    PYTHONPATH=src .venv/bin/python examples/hf_load_rss.py [--fsdp-version 1|2] [--lora-rank R] [--base-dtype bf16]
        [--quantize-base nf4] [--steps N]
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _rank(rank: int, world: int, path: str, version: int, lora: int, init: str, out, base_dtype: str = "fp32",
          steps: int = 0, quantize: str = "none") -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    import peft  # noqa: F401  (imports are not the load)
    import transformers  # noqa: F401
    if quantize != "none":
        import torchao.quantization  # noqa: F401

    from fullshard.train.config import TrainConfig
    from fullshard.train.trainer import Trainer

    cfg = TrainConfig(data_dir="unused", max_positions=2048, vocab_size=32000, fp16_scale_window=1, hf_model=path,
                      fsdp_version=version, lora_rank=lora, lora_target_modules="q_proj,v_proj" if lora else None,
                      base_dtype=base_dtype, quantize_base=quantize)
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (peak RSS) to the current RSS
    before = _status_kib("VmRSS")
    trainer = Trainer(cfg, torch.device("cpu"))
    from fullshard.core import collectives

    gen = torch.Generator().manual_seed(rank)
    traffic = []  # per update: (bytes all-gathered, bytes reduce-scattered) by this rank
    for _ in range(steps):
        tokens = torch.randint(0, 32000, (2, 65), generator=gen)
        collectives.reset_counts()
        trainer.train_step([(tokens[:, :-1], tokens[:, 1:])])
        # BYTES counts an all-gather's input (this rank's shard): times the group size is its output.
        traffic.append((collectives.BYTES["all_gather"] * world, collectives.BYTES["reduce_scatter"]))
    peak = _status_kib("VmHWM")
    from fullshard import memory_stats

    local = sum(u["sharded_bytes"] for k, u in memory_stats(trainer.model).items() if k != "pool")
    out.put((rank, (peak - before) * 1024, local, traffic))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fsdp-version", type=int, default=2, choices=(1, 2))
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--base-dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--quantize-base", default="none", choices=("none", "nf4"))
    parser.add_argument("--steps", type=int, default=0)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                         num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
                         tie_word_embeddings=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "llama")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        params = sum(p.numel() for p in model.parameters())
        full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        model.save_pretrained(path)
        del model
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, 2, path, args.fsdp_version, args.lora_rank,
                                                 os.path.join(tmp, "init"), out, args.base_dtype,
                                                 args.steps, args.quantize_base)) for r in range(2)]
        for p in procs:
            p.start()
        results = sorted(out.get() for _ in procs)
        for p in procs:
            p.join()
    print(f"model: {params / 1e6:.1f}M parameters, {full_bytes / 2**20:.0f} MiB in fp32; fsdp-version "
          f"{args.fsdp_version}, lora-rank {args.lora_rank}, base {args.base_dtype}, quantize-base "
          f"{args.quantize_base}, {args.steps} updates, 2 ranks")
    for rank, growth, local, traffic in results:
        print(f"rank {rank}: peak RSS growth during the load and updates {growth / 2**20:.0f} MiB = "
              f"{growth / full_bytes:.2f}x the full model (its shards: {local:,} bytes = {local / 2**20:.0f} MiB)")
        for i, (ag, rs) in enumerate(traffic):
            print(f"rank {rank}: update {i + 1}: all-gathered {ag:,} bytes ({ag / 2**20:.2f} MiB), "
                  f"reduce-scattered {rs:,} bytes ({rs / 2**20:.2f} MiB)")


if __name__ == "__main__":
    main()

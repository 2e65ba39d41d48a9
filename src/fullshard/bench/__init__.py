"""Benchmarks. ``python -m fullshard.bench.compare`` (``make bench``) trains the
same GPT with fullshard, torch DDP and torch FSDP1 and prints speed, per-rank
model-state bytes and communication side by side; see :mod:`.compare`."""

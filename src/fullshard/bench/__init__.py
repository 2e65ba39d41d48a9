"""Benchmarks. ``fullshard bench`` (``make bench``; :mod:`.suite`) trains the
same GPT under fullshard's sharding strategies, torch DDP, torch FSDP2 and
FSDP1 (and DeepSpeed ZeRO-3 when installed), one launch per mode, and reports
speed, peak memory and communication side by side; ``fullshard plan``
(:mod:`.plan`) estimates memory; ``python -m fullshard.bench.memory`` measures
fullshard's memory features."""

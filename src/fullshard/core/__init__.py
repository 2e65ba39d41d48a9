"""The FSDP engine: sharding math, units, hooks and collectives."""

"""The `fullshard` command line: fairseq-style GPT training on FSDP or DDP.

Modules: `cli` (console script), `options` (flags + validation), `config`
(TrainConfig), `launcher` (elastic launch / torchrun), `loop` (per-rank entry
and epochs), `trainer` (model, optimizer, steps, checkpoint), `progress`
(fairseq log formats), `lr_scheduler`, `plot`.
"""

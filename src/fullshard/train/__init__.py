"""The trainer behind the `fullshard` command line (`fullshard.cli`): fairseq-style GPT training on
FSDP or DDP, evaluation, generation and memory planning.

Modules: `flags` (a flag is a dataclass field), `config` (the option groups and
TrainConfig), `options` (the train parser and validation), `launcher` (elastic
launch / torchrun), `loop` (per-rank entry and epochs), `trainer` (model,
optimizer, steps), `checkpoint_utils`, `progress` (fairseq log formats),
`lr_scheduler`, `eval_lm`, `generate`, `trained_model` (a checkpoint's model),
`plan` (memory planner), `plot`.
"""

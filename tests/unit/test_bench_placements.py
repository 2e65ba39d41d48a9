"""``python -m fullshard.bench.placements``: balance and padding of placements
for a GPT's units (no process group)."""
from __future__ import annotations

import pytest
import torch

from fullshard.bench import placements as bench
from fullshard.models import build_model


def _model():
    with torch.device("meta"):
        return build_model("transformer_lm_gpt_tiny", vocab_size=1000, max_positions=64)


def test_row_shards_are_balanced_and_owned_matrices_cost_padding():
    model = _model()
    for world in range(2, 9):
        row = bench.measure(model, "row", world)
        owned = bench.measure(model, "owned", world)
        assert row["max_over_mean"] < 1.02 and row["padding_share"] < 0.02, row
        assert owned["numel"] == row["numel"] == sum(p.numel() for p in model.parameters())
        assert owned["ns_max_over_mean"] >= 1.0 and owned["max_over_mean"] >= 1.0, owned
    # 4 block matrices (3, 1, 4, 4 units of C·C) over 2 ranks: the best split per block is 7 / 5,
    # and ties rotate by unit, so neither rank is the heavier one in every block.
    two = bench.measure(model, "owned", 2)
    assert two["max_over_mean"] < 7 / 6 and two["ns_max_over_mean"] < 7 / 6, two


def test_cli_prints_a_row_per_world_and_placement(capsys):
    assert bench.main(["--arch", "transformer_lm_gpt_tiny", "--vocab-size", "1000", "--max-positions", "64",
                       "--min-world", "2", "--max-world", "3", "--blocks-per-unit", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + 2 * 3 and "owned" in lines[-1]
    with pytest.raises(SystemExit):
        bench.main(["--min-world", "3", "--max-world", "2"])

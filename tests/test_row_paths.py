"""Per-layer row-count rules (twell.model.choose_row_paths): the rule from measured wins, and the choice on a
model with the timing replaced (CPU; the GPU timing itself is the benchmark's)."""
from __future__ import annotations

import pytest
import torch

from twell.model import ModelConfig, build_model, choose_row_paths, sparse_ffns
from twell.model.row_paths import ALL_ROWS, row_rule


@pytest.mark.parametrize("wins,expect", [
    ({1: True, 4: True, 16: True, 32: False, 64: False, 2048: True, 4096: True}, (16, (17, 2047))),
    ({1: True, 16: True, 32: True, 64: True}, (32, (33, 63))),      # 33-63 rows unmeasured: dense
    ({1: True, 32: True, 33: True}, (32, None)),                    # sparse at every row count
    ({1: True, 2: True}, (2, (3, ALL_ROWS))),                       # past the grid: unmeasured, dense
    ({1: False, 16: True, 64: False}, (0, (1, ALL_ROWS))),          # a win after a loss does not count
    ({1: True, 64: False, 128: True, 256: False}, (1, (2, ALL_ROWS))),  # past the grid: the largest count lost
    ({1: True, 8: True, 64: True, 128: True}, (8, (9, 63))),        # large-batch op from 64 on, decode up to 8
    ({48: True, 64: True}, (0, (1, 47))),
    # a loss inside the decoding op's range: its wins above it are not the large-batch op's
    ({1: True, 4: False, 8: True, 16: True, 32: True, 64: True, 128: True}, (1, (2, 63))),
    ({1: False, 2: True, 32: True}, (0, (1, ALL_ROWS))),
])
def test_row_rule(wins, expect):
    assert row_rule(wins) == expect


def _model():
    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=2,
                     max_position_embeddings=128)
    return build_model(mc).to(torch.bfloat16).eval()


def test_choose_row_paths_sets_each_layer_from_its_timings():
    model = _model()
    ffns = sparse_ffns(model)
    calls = []

    def timer(fns, device):  # layer 0: sparse wins up to 4 rows and from 64; layer 1: never
        out = {name: fn() for name, fn in fns.items()}
        m = out["dense"].shape[0]
        assert torch.allclose(out["sparse"].float(), out["dense"].float(), atol=2e-2, rtol=2e-2)
        layer = len(calls) // 5  # five row counts per layer fit in its 128 tokens
        calls.append(m)
        wins = layer == 0 and (m <= 4 or m >= 64)
        return {"dense": 1.0, "sparse": 0.5 if wins else 2.0}

    ids = torch.randint(0, 97, (2, 64))  # 128 tokens per layer
    report = choose_row_paths(model, input_ids=ids, rows=(1, 4, 16, 64, 128, 4096), timer=timer)
    assert [r["tokens"] for r in report] == [128, 128]
    assert sorted(report[0]["times"]) == [1, 4, 16, 64, 128]  # 4096 rows: more than the batch holds
    assert (ffns[0].decode_rows, ffns[0].dense_rows) == (4, (5, 63))
    assert (ffns[1].decode_rows, ffns[1].dense_rows) == (0, (1, ALL_ROWS))
    assert [r["why"] for r in report] == [None, None]


def test_choose_row_paths_leaves_layers_it_cannot_time():
    model = _model()
    ffns = sparse_ffns(model)
    ffns[1].path = "dense"
    before = (ffns[0].decode_rows, ffns[0].dense_rows)
    report = choose_row_paths(model, input_ids=torch.randint(0, 97, (1, 16)), rows=(1, 8),
                              timer=lambda fns, d: {"dense": 1.0, "sparse": 1.0})  # a tie: never a win
    assert "path 'dense'" in report[1]["why"] and ffns[1].dense_rows == before[1]
    assert (ffns[0].decode_rows, ffns[0].dense_rows) == (0, (1, ALL_ROWS))
    untimed = choose_row_paths(model, input_ids=torch.randint(0, 97, (1, 16)))  # CPU, no timer: nothing to time
    assert untimed[0]["why"].startswith("input on cpu") and untimed[0]["times"] == {}
    with pytest.raises(ValueError, match="min_gain"):
        choose_row_paths(model, input_ids=torch.randint(0, 97, (1, 8)), min_gain=1.5)

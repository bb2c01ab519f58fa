"""twell.model.synthetic: a random-weight checkpoint in a public format with its FATReLU gates calibrated to
an activity; it loads through load_pretrained and each layer keeps the activity it was calibrated to."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from twell.bench.__main__ import main
from twell.model import load_pretrained
from twell.model.llama import capture_ffn_inputs, sparse_ffns
from twell.model.synthetic import calibrate_fatrelu, shape_config, synthetic_checkpoint


@pytest.mark.parametrize("active", [0.05, 0.11])
def test_checkpoint_loads_with_each_layer_at_its_activity(tmp_path, active):
    info = synthetic_checkpoint("tiny-fatrelu", tmp_path / "ck", active, device="cpu", calib_tokens=1024,
                                progress=False)
    assert len(info["measured_active"]) == shape_config("tiny-fatrelu").num_layers
    assert all(abs(a - active) < 0.01 for a in info["measured_active"]), info
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["hidden_act"] == "fatrelu" and cfg["hidden_act_param"] == 0.01  # the format's own keys
    assert cfg["twell_synthetic"]["target_active"] == active
    model, _ = load_pretrained(tmp_path / "ck", ffn_path="dense", dtype=torch.bfloat16, load_tokenizer=False)
    ids = torch.randint(0, 256, (2, 256), generator=torch.Generator().manual_seed(5))  # other tokens
    ffns = sparse_ffns(model)
    xs = capture_ffn_inputs(model, ffns, input_ids=ids)
    for f, x in zip(ffns, xs):
        a = float((F.linear(x, f.gate_proj.weight) > f.threshold).float().mean())
        assert abs(a - active) < 0.03, a


def test_calibration_refuses_what_it_cannot_reach(tmp_path):
    synthetic_checkpoint("tiny-fatrelu", tmp_path / "ck", 0.1, device="cpu", calib_tokens=256, progress=False)
    model, _ = load_pretrained(tmp_path / "ck", ffn_path="dense", load_tokenizer=False)
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="fraction"):
        calibrate_fatrelu(model, ids, 0.6, progress=False)
    with pytest.raises(ValueError, match="unknown shape"):
        shape_config("gpt-5")


def test_cli_writes_the_checkpoint(tmp_path, capsys):
    assert main(["synthetic", "--shape", "tiny-fatrelu", "--active", "0.1", "--out", str(tmp_path / "ck"),
                 "--device", "cpu", "--calib-tokens", "512", "--quiet"]) == 0
    assert "2 layers" in capsys.readouterr().out and (tmp_path / "ck" / "config.json").is_file()

"""load_pretrained on the public ReLU checkpoints' formats, written here as small synthetic checkpoints with
each format's config keys and weight layout (nothing is downloaded): ProSparse-Llama-2 (FATReLU), MiniCPM-S
(FATReLU, GQA, MiniCPM's scaling), ReluLLaMA (plain ReLU Llama) and TurboSparse-Mistral (bamboo: dReLU,
GQA, a sliding window, predictor weights). Logits are compared with an fp64 forward written in this file
from the formats' published formulas."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from twell.model import load_pretrained, save_pretrained, sparse_ffns

V, D, H, L, HEADS = 96, 64, 192, 2, 4


def _common(kv_heads: int) -> dict:
    return {"vocab_size": V, "hidden_size": D, "intermediate_size": H, "num_hidden_layers": L,
            "num_attention_heads": HEADS, "num_key_value_heads": kv_heads, "max_position_embeddings": 64,
            "rms_norm_eps": 1e-5, "initializer_range": 0.02, "bos_token_id": 1, "eos_token_id": 2,
            "use_cache": True}


def prosparse_config(t=0.3):
    return {"architectures": ["SparseLlamaForCausalLM"], "model_type": "llama", "hidden_act": "fatrelu",
            "hidden_act_param": t, "pretraining_tp": 1, "rope_scaling": None, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "torch_dtype": "float32", **_common(HEADS)}


def minicpm_config(t=0.3):
    # MiniCPM-S-1B's keys; no tie_word_embeddings: MiniCPM's config class ties by default
    return {"architectures": ["MiniCPMForCausalLM"], "model_type": "minicpm",
            "auto_map": {"AutoConfig": "configuration_minicpm.MiniCPMConfig",
                         "AutoModelForCausalLM": "modeling_minicpm.MiniCPMForCausalLM"},
            "hidden_act": "fatrelu", "hidden_act_param": t, "scale_emb": 12, "scale_depth": 1.4,
            "dim_model_base": 16, "rope_scaling": None, "torch_dtype": "bfloat16", **_common(2)}


def relullama_config():
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "relu",
            "pretraining_tp": 1, "rope_scaling": None, "tie_word_embeddings": False, "torch_dtype": "float16",
            **_common(HEADS)}


def turbosparse_config(window=5):
    return {"architectures": ["BambooForCausalLM"], "model_type": "bamboo", "attention_dropout": 0.0,
            "auto_map": {"AutoConfig": "configuration_bamboo.BambooConfig",
                         "AutoModelForCausalLM": "modeling_bamboo.BambooForCausalLM"},
            "hidden_act": "relu", "rope_theta": 10000.0, "sliding_window": window, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", **_common(2)}


def _weights(cfg: dict, seed: int, tied: bool, predictor: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    kv = cfg["num_key_value_heads"] * (D // HEADS)

    def w(*shape, std=0.1):
        return torch.randn(*shape, generator=g) * std

    sd = {"model.embed_tokens.weight": w(V, D, std=1.0 / math.sqrt(D) if cfg.get("scale_emb") else 1.0),
          "model.norm.weight": 1 + w(D)}
    for i in range(L):
        p = f"model.layers.{i}."
        sd.update({p + "input_layernorm.weight": 1 + w(D), p + "post_attention_layernorm.weight": 1 + w(D),
                   p + "self_attn.q_proj.weight": w(D, D), p + "self_attn.k_proj.weight": w(kv, D),
                   p + "self_attn.v_proj.weight": w(kv, D), p + "self_attn.o_proj.weight": w(D, D),
                   p + "mlp.gate_proj.weight": w(H, D), p + "mlp.up_proj.weight": w(H, D),
                   p + "mlp.down_proj.weight": w(D, H)})
        if predictor:  # TurboSparse keeps its activity predictor beside each MLP
            sd.update({p + "mlp.predictor.fc1.weight": w(16, D), p + "mlp.predictor.fc2.weight": w(H, 16)})
    if not tied:
        sd["lm_head.weight"] = w(V, D)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg["torch_dtype"]]
    return {k: v.to(dtype).contiguous() for k, v in sd.items()}


def _write(path, cfg, sd, layout):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    keys = sorted(sd)
    halves = [keys[: len(keys) // 2], keys[len(keys) // 2:]]
    if layout == "safetensors-sharded":
        names = [f"model-0000{i + 1}-of-00002.safetensors" for i in range(2)]
        for name, part in zip(names, halves):
            save_file({k: sd[k] for k in part}, str(path / name))
        index = {"metadata": {"total_size": 0}, "weight_map": {k: n for n, part in zip(names, halves) for k in part}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    elif layout == "bin":
        torch.save(sd, path / "pytorch_model.bin")
    elif layout == "bin-sharded":
        names = [f"pytorch_model-0000{i + 1}-of-00002.bin" for i in range(2)]
        for name, part in zip(names, halves):
            torch.save({k: sd[k] for k in part}, path / name)
        index = {"metadata": {"total_size": 0}, "weight_map": {k: n for n, part in zip(names, halves) for k in part}}
        (path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    return path


def reference_logits(cfg: dict, sd: dict, ids: torch.Tensor, *, gate: str | None = None) -> torch.Tensor:
    """fp64 logits of a checkpoint of one of the four formats, from the formats' formulas: RMSNorm, RoPE
    (rotate-half), grouped-query causal attention (a query sees the last ``sliding_window`` keys,
    itself included, for the Mistral formats), the MLP of its ``hidden_act`` (dReLU for bamboo) and
    MiniCPM's three scalings. ``gate`` overrides the MLP (a wrong one must change the logits)."""
    W = {k: v.double() for k, v in sd.items()}
    B, T = ids.shape
    nh, nkv, hd = HEADS, cfg["num_key_value_heads"], D // HEADS
    eps, theta = cfg["rms_norm_eps"], cfg.get("rope_theta", 10000.0)
    minicpm = cfg["model_type"] == "minicpm"
    gate = gate or ("drelu" if cfg["model_type"] == "bamboo" else cfg["hidden_act"])
    t = cfg.get("hidden_act_param", 0.0)
    res = cfg["scale_depth"] / math.sqrt(L) if minicpm else 1.0

    def norm(h, w):
        return w * h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps)

    ang = torch.arange(T, dtype=torch.float64)[:, None] / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rope(q):
        return q * cos + torch.cat([-q[..., hd // 2:], q[..., : hd // 2]], -1) * sin

    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    allowed = j <= i
    if cfg.get("sliding_window"):
        allowed &= i - j < cfg["sliding_window"]
    h = W["model.embed_tokens.weight"][ids] * (cfg["scale_emb"] if minicpm else 1.0)
    for layer in range(L):
        p = f"model.layers.{layer}."
        x = norm(h, W[p + "input_layernorm.weight"])
        q = (x @ W[p + "self_attn.q_proj.weight"].t()).view(B, T, nh, hd).transpose(1, 2)
        k = (x @ W[p + "self_attn.k_proj.weight"].t()).view(B, T, nkv, hd).transpose(1, 2)
        v = (x @ W[p + "self_attn.v_proj.weight"].t()).view(B, T, nkv, hd).transpose(1, 2)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        s = (rope(q) @ rope(k).transpose(-1, -2)) / math.sqrt(hd)
        a = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v
        h = h + (a.transpose(1, 2).reshape(B, T, D) @ W[p + "self_attn.o_proj.weight"].t()) * res
        x = norm(h, W[p + "post_attention_layernorm.weight"])
        g, u = x @ W[p + "mlp.gate_proj.weight"].t(), x @ W[p + "mlp.up_proj.weight"].t()
        if gate == "fatrelu":
            hid = torch.where(g > t, g, 0.0) * u
        elif gate == "drelu":
            hid = F.relu(g) * F.relu(u)
        else:
            hid = F.relu(g) * u
        h = h + (hid @ W[p + "mlp.down_proj.weight"].t()) * res
    h = norm(h, W["model.norm.weight"])
    if minicpm:
        h = h / (D / cfg["dim_model_base"])
    return h @ W.get("lm_head.weight", W["model.embed_tokens.weight"]).t()


FORMATS = {
    "prosparse": (prosparse_config, False, "safetensors-sharded", "fatrelu"),
    "minicpm-s": (minicpm_config, True, "bin", "fatrelu"),
    "relullama": (relullama_config, False, "bin-sharded", "relu"),
    "turbosparse": (turbosparse_config, False, "safetensors-sharded", "drelu"),
}


def _checkpoint(tmp_path, name, seed):
    make, tied, layout, _ = FORMATS[name]
    cfg = make()
    sd = _weights(cfg, seed, tied, predictor=name == "turbosparse")
    return _write(tmp_path / name, cfg, sd, layout), cfg, sd


def _rel(a, b):
    return float((a.double() - b).norm() / b.norm())


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_format_loads_with_sparse_ffns_and_the_reference_logits(name, tmp_path, seed):
    path, cfg, sd = _checkpoint(tmp_path, name, seed)
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(seed))
    want = reference_logits(cfg, sd, ids)
    model, tok = load_pretrained(path, ffn_path="dense", dtype=torch.float32, load_tokenizer=False)
    assert tok is None
    ffns = sparse_ffns(model)
    assert len(ffns) == L and {f.activation for f in ffns} == {FORMATS[name][3]}
    with torch.no_grad():
        got = model(input_ids=ids).logits
    err = _rel(got, want)
    assert err < 1e-5, err
    wrong = "relu" if FORMATS[name][3] != "relu" else "drelu"
    assert _rel(got, reference_logits(cfg, sd, ids, gate=wrong)) > 100 * max(err, 1e-7)  # the MLP matters


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_format_on_the_sparse_reference_path_is_as_close_as_dense_bf16(name, tmp_path, seed):
    """bf16 on the TwELL reference ops: within a small multiple of what dense bf16 makes of the same model."""
    path, cfg, sd = _checkpoint(tmp_path, name, seed)
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(seed + 1))
    want = reference_logits(cfg, {k: v.to(torch.bfloat16) for k, v in sd.items()}, ids)
    errs = {}
    for path_name in ("dense", "reference"):
        model, _ = load_pretrained(path, ffn_path=path_name, dtype=torch.bfloat16, load_tokenizer=False)
        with torch.no_grad():
            errs[path_name] = _rel(model(input_ids=ids).logits, want)
        ran = {f.last_path for f in sparse_ffns(model)}
        assert ran == {"dense" if path_name == "dense" else "twell-reference"}, ran
    assert errs["reference"] < 3 * errs["dense"] + 1e-3, errs


def test_turbosparse_window_and_predictors(tmp_path, seed):
    """Past the sliding window the Mistral mask decides the logits (a Llama would differ); the predictor
    weights are dropped."""
    path, cfg, sd = _checkpoint(tmp_path, "turbosparse", seed)
    model, _ = load_pretrained(path, ffn_path="dense", dtype=torch.float32, load_tokenizer=False)
    assert type(model).__name__ == "MistralForCausalLM" and model.config.sliding_window == 5
    assert not any("predictor" in k for k in model.state_dict())
    ids = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        got = model(input_ids=ids).logits
    assert _rel(got, reference_logits(cfg, sd, ids)) < 1e-5
    assert _rel(got, reference_logits({**cfg, "sliding_window": None}, sd, ids)) > 1e-3


def test_minicpm_scaling_is_in_the_model(tmp_path, seed):
    path, cfg, sd = _checkpoint(tmp_path, "minicpm-s", seed)
    model, _ = load_pretrained(path, ffn_path="dense", dtype=torch.float32, load_tokenizer=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # MiniCPM ties by default
    assert model.config.num_key_value_heads == 2 and model.model.layers[0].mlp.threshold == 0.3
    ids = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        got = model(input_ids=ids).logits
    for key, value in (("scale_emb", 1), ("scale_depth", math.sqrt(L)), ("dim_model_base", D)):
        assert _rel(got, reference_logits({**cfg, key: value}, sd, ids)) > 1e-3, key  # each scaling matters
    with pytest.raises(ValueError, match="MiniCPM's scaling"):
        save_pretrained(model, None, tmp_path / "out")


def test_fatrelu_model_saves_and_loads_back(tmp_path, seed):
    path, cfg, sd = _checkpoint(tmp_path, "prosparse", seed)
    model, _ = load_pretrained(path, ffn_path="dense", dtype=torch.float32, load_tokenizer=False)
    save_pretrained(model, None, tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["hidden_act"] == "fatrelu" and saved["hidden_act_param"] == 0.3  # plain transformers refuses it
    again, _ = load_pretrained(tmp_path / "saved", ffn_path="dense", load_tokenizer=False)
    ids = torch.randint(0, V, (1, 7))
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("name,change,key", [
    ("prosparse", {"hidden_act_param": None}, "hidden_act_param"),
    ("prosparse", {"hidden_act_param": -0.1}, "hidden_act_param"),
    ("prosparse", {"hidden_act": "gelu"}, "hidden_act"),
    ("minicpm-s", {"dim_model_base": None}, "dim_model_base"),
    ("minicpm-s", {"scale_depth": 0}, "scale_depth"),
    ("minicpm-s", {"num_experts": 8}, "num_experts"),
    ("minicpm-s", {"rope_scaling": {"type": "longrope", "short_factor": [1.0]}}, "rope_scaling"),
    ("relullama", {"scale_emb": 12}, "scale_emb"),
    ("relullama", {"sliding_window": 8}, "sliding_window"),
    ("relullama", {"model_type": "qwen2"}, "model_type"),
    ("turbosparse", {"hidden_act": "silu"}, "hidden_act"),
    ("turbosparse", {"sliding_window": 0}, "sliding_window"),
])
def test_what_cannot_be_computed_exactly_names_the_config_key(name, change, key, tmp_path):
    path, cfg, sd = _checkpoint(tmp_path, name, 0)
    (path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ValueError, match=key):
        load_pretrained(path, load_tokenizer=False)


def test_kernel_path_on_a_fatrelu_checkpoint_is_refused_with_the_reason(tmp_path):
    """More rows than the decoding op takes (the only kernel that computes FATReLU): refused, naming it."""
    path, _, _ = _checkpoint(tmp_path, "prosparse", 0)
    model, _ = load_pretrained(path, ffn_path="kernel", dtype=torch.bfloat16, load_tokenizer=False)
    with torch.no_grad(), pytest.raises(ValueError, match="FATReLU"):
        model(input_ids=torch.zeros(1, 40, dtype=torch.long))

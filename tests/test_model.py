"""twell.model: Llama with SparseFFN MLPs, Hugging Face save/load, loading the paper's checkpoint format."""
import json
import random

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from twell.model import (ModelConfig, build_model, cast_parameters, from_hf_dict, load_pretrained, save_pretrained,
                         set_ffn_path, set_tracking, sparse_ffns)
from twell.nn import SparseFFN

pytestmark = pytest.mark.usefixtures("seed")  # random shapes and weights: a failure names its seed


def _random_cfg(ffn="relu_gated", rng=None) -> ModelConfig:
    """Small odd shapes: head counts and widths that are not powers of two."""
    rng = rng or random  # seeded per test by the seed fixture
    heads = rng.choice([1, 2, 3])
    kv = rng.choice([h for h in (1, heads) if heads % h == 0])
    return ModelConfig(vocab_size=rng.randint(50, 130), hidden_size=heads * rng.choice([8, 12, 16]),
                       intermediate_size=rng.randint(17, 90), num_layers=rng.randint(1, 3), num_heads=heads,
                       num_kv_heads=kv, ffn=ffn, max_position_embeddings=64, rope_theta=1e5)


def _ids(mc: ModelConfig, b=2, t=None):
    return torch.randint(0, mc.vocab_size, (b, t or random.randint(3, 17)))


def _plain_llama(mc: ModelConfig, state: dict) -> LlamaForCausalLM:
    hf = LlamaConfig(vocab_size=mc.vocab_size, hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
                     num_hidden_layers=mc.num_layers, num_attention_heads=mc.num_heads,
                     num_key_value_heads=mc.num_kv_heads, hidden_act=mc.activation, rms_norm_eps=mc.rms_norm_eps,
                     tie_word_embeddings=True, rope_theta=mc.rope_theta, max_position_embeddings=64)
    m = LlamaForCausalLM(hf)
    m.load_state_dict(state, strict=False)
    return m.eval()


@pytest.mark.parametrize("ffn", ["relu_gated", "silu_gated"])
def test_build_model_is_a_llama_with_sparse_ffns(ffn):
    mc = _random_cfg(ffn)
    model = build_model(mc).eval()
    ffns = sparse_ffns(model)
    assert len(ffns) == mc.num_layers and all(isinstance(f, SparseFFN) for f in ffns)
    assert all(f.activation == mc.activation for f in ffns)
    plain = _plain_llama(mc, model.state_dict())
    assert set(model.state_dict()) == set(plain.state_dict())  # Llama parameter names, nothing extra
    set_ffn_path(model, "dense")
    x = _ids(mc)
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, plain(input_ids=x).logits)


def test_rope_theta_and_config_fields_reach_transformers():
    mc = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=2, num_kv_heads=2,
                     rope_theta=12345.0)
    cfg = build_model(mc).config
    assert cfg.hidden_act == "relu" and cfg.tie_word_embeddings and cfg.twell_ffn == "relu_gated"
    from twell.model.config import rope_theta_of

    assert rope_theta_of(cfg) == 12345.0


def test_nongated_variant_computes_relu_up():
    mc = _random_cfg("relu")
    model = build_model(mc).eval()
    ffn = sparse_ffns(model)[0]
    assert ffn.gate_proj is None and not any("gate_proj" in k for k in model.state_dict())
    x = torch.randn(3, 5, mc.hidden_size)
    with torch.no_grad():
        ref = ffn.down_proj(torch.relu(ffn.up_proj(x)))
        ffn.path = "dense"
        torch.testing.assert_close(ffn(x), ref)


def test_save_pretrained_loads_in_plain_transformers_with_identical_logits(tmp_path):
    mc = _random_cfg()
    model = build_model(mc).eval()
    save_pretrained(model, None, tmp_path / "ck")
    plain = LlamaForCausalLM.from_pretrained(tmp_path / "ck").eval()
    assert type(plain.model.layers[0].mlp).__name__ == "LlamaMLP" and plain.config.hidden_act == "relu"
    set_ffn_path(model, "dense")
    x = _ids(mc)
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, plain(input_ids=x).logits)


def test_bf16_sharded_save_and_twell_load_round_trip(tmp_path):
    from twell.data.tokenizer import train_bpe

    mc = _random_cfg()
    mc.vocab_size = 300
    tok = train_bpe(["a first tiny document about sparse models", "and a second one, about dense models"] * 20, 300)
    model = build_model(mc).eval()
    choice = {"kind": "trained", "name": "bpe300"}
    save_pretrained(model, tok, tmp_path / "ck", max_shard_size="4KB", dtype=torch.bfloat16, tokenizer_choice=choice)
    assert (tmp_path / "ck" / "model.safetensors.index.json").is_file()
    plain = LlamaForCausalLM.from_pretrained(tmp_path / "ck").eval()
    assert plain.dtype == torch.bfloat16
    loaded, tok2 = load_pretrained(tmp_path / "ck", ffn_path="dense")
    assert loaded.dtype == torch.bfloat16 and loaded.config.twell_tokenizer == choice
    # RoPE frequencies stay fp32 as in transformers' own bf16 load (bf16 ones shift every angle)
    assert loaded.model.rotary_emb.inv_freq.dtype == torch.float32
    assert tok2 is not None and tok2.encode("sparse models") == tok.encode("sparse models")
    x = _ids(mc)
    with torch.no_grad():
        a, b = loaded(input_ids=x).logits, plain(input_ids=x).logits
        set_ffn_path(model, "dense")
        c = cast_parameters(model, torch.bfloat16)(input_ids=x).logits
    assert torch.equal(a, b) and torch.equal(a, c)


def test_save_does_not_change_the_model(tmp_path):
    mc = _random_cfg()
    model = build_model(mc)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    save_pretrained(model, None, tmp_path / "ck", dtype="bf16")
    assert all(torch.equal(before[k], v) and v.dtype == torch.float32 for k, v in model.state_dict().items())


def _paper_style_checkpoint(path, mc: ModelConfig, gated: bool, extra_state=None):
    """A synthetic checkpoint in the format of the paper's released models (random weights, Llama keys)."""
    state = {"model.embed_tokens.weight": torch.randn(mc.vocab_size, mc.hidden_size) * 0.5,
             "model.norm.weight": 1 + 0.1 * torch.randn(mc.hidden_size)}
    D, H, hd = mc.hidden_size, mc.intermediate_size, mc.hidden_size // mc.num_heads
    for i in range(mc.num_layers):
        p = f"model.layers.{i}."
        state[p + "self_attn.q_proj.weight"] = torch.randn(D, D) * 0.2
        state[p + "self_attn.k_proj.weight"] = torch.randn(mc.num_kv_heads * hd, D) * 0.2
        state[p + "self_attn.v_proj.weight"] = torch.randn(mc.num_kv_heads * hd, D) * 0.2
        state[p + "self_attn.o_proj.weight"] = torch.randn(D, D) * 0.2
        if gated:
            state[p + "mlp.gate_proj.weight"] = torch.randn(H, D) * 0.2
        state[p + "mlp.up_proj.weight"] = torch.randn(H, D) * 0.2
        state[p + "mlp.down_proj.weight"] = torch.randn(D, H) * 0.2
        state[p + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(D)
        state[p + "post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(D)
    state.update(extra_state or {})
    path.mkdir(parents=True)
    save_file(state, str(path / "model.safetensors"))
    cfg = {  # as in the paper's SparseLlamaConfig: hidden_act says silu, the MLP is ReLU
        "architectures": ["SparseLlamaForCausalLM"], "model_type": "llama_sparse_relu", "hidden_act": "silu",
        "hidden_size": D, "intermediate_size": H, "num_hidden_layers": mc.num_layers,
        "num_attention_heads": mc.num_heads, "num_key_value_heads": mc.num_kv_heads, "vocab_size": mc.vocab_size,
        "rope_theta": 100000, "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "max_position_embeddings": 64,
        "bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "float32", "attention_bias": False, "mlp_bias": False,
        "sparsity_gated_mlp": gated, "sparsity_l1_coeff": 2e-5, "sparsity_new_intermediate_size": H,
        "sparsity_reinitialize": True, "sparsity_mlp_execution_logic": "training",
    }
    (path / "config.json").write_text(json.dumps(cfg))
    return state


def test_loads_paper_format_checkpoint_as_relu_gated_llama(tmp_path):
    mc = _random_cfg()
    state = _paper_style_checkpoint(tmp_path / "paper", mc, gated=True)
    model, tok = load_pretrained(tmp_path / "paper", ffn_path="dense")
    assert tok is None
    ffns = sparse_ffns(model)
    assert all(f.activation == "relu" and f.gated for f in ffns)
    ref = _plain_llama(ModelConfig(**{**mc.to_dict(), "ffn": "relu_gated"}), state)  # hidden_act relu
    x = _ids(mc)
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, ref(input_ids=x).logits)
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_loads_paper_format_nongated_checkpoint(tmp_path):
    mc = _random_cfg("relu")
    state = _paper_style_checkpoint(tmp_path / "paper", mc, gated=False)
    model, _ = load_pretrained(tmp_path / "paper")
    ffn = sparse_ffns(model)[0]
    assert not ffn.gated and torch.equal(ffn.up_proj.weight, state["model.layers.0.mlp.up_proj.weight"])


def test_load_rejects_mismatched_checkpoints(tmp_path):
    mc = _random_cfg()
    _paper_style_checkpoint(tmp_path / "extra", mc, gated=True, extra_state={"model.layers.0.mlp.bogus": torch.ones(2)})
    with pytest.raises(ValueError, match="unexpected.*bogus"):
        load_pretrained(tmp_path / "extra")
    state = _paper_style_checkpoint(tmp_path / "missing", mc, gated=True)
    state.pop("model.norm.weight")
    save_file(state, str(tmp_path / "missing" / "model.safetensors"))
    with pytest.raises(ValueError, match="missing.*model.norm.weight"):
        load_pretrained(tmp_path / "missing")
    cfg = json.loads((tmp_path / "extra" / "config.json").read_text())
    cfg["intermediate_size"] = cfg["sparsity_new_intermediate_size"] = mc.intermediate_size + 1
    _paper_style_checkpoint(tmp_path / "shape", mc, gated=True)
    (tmp_path / "shape" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="wrong shape"):
        load_pretrained(tmp_path / "shape")


def test_load_errors_name_the_problem(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="checkpoint directory"):
        load_pretrained(tmp_path / "nope")
    # A missing "runs/final" beside a local ./runs is a missing path, not a hub id to download.
    import huggingface_hub

    calls = []

    def fake_download(repo_id, **kw):
        calls.append((repo_id, kw.get("local_files_only")))
        raise RuntimeError("no network in tests")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(FileNotFoundError, match="not tried as a hub id because ./runs is a local folder"):
        load_pretrained("runs/final")
    assert calls == []
    # TWELL_ALLOW_NETWORK=0 keeps a hub id in the local cache; unset, an explicit hub id may download.
    monkeypatch.setenv("TWELL_ALLOW_NETWORK", "0")
    with pytest.raises(FileNotFoundError, match="local Hugging Face cache only"):
        load_pretrained("twell-tests/not-here")
    monkeypatch.delenv("TWELL_ALLOW_NETWORK")
    with pytest.raises(FileNotFoundError, match="online"):
        load_pretrained("twell-tests/not-here")
    assert calls == [("twell-tests/not-here", True), ("twell-tests/not-here", False)]
    monkeypatch.undo()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="local Hugging Face cache only"):
        load_pretrained("twell-tests/definitely-not-cached")
    with pytest.raises(ValueError, match="hidden_act"):
        from_hf_dict({"model_type": "llama", "hidden_act": "gelu", "hidden_size": 8, "intermediate_size": 8,
                      "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 10})



def _saved_plain_llama(path, **kw):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                      hidden_act="relu", max_position_embeddings=64, **kw)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return json.loads((path / "config.json").read_text())


def test_plain_llama_config_fields_mean_what_transformers_reads(tmp_path):
    """A config.json read as transformers reads it: no tie_word_embeddings means untied (LlamaConfig's
    default), and the token ids (several eos ids, a pad id) and generation settings survive loading."""
    raw = _saved_plain_llama(tmp_path, tie_word_embeddings=False, eos_token_id=[4, 7, 9], pad_token_id=11,
                             bos_token_id=3)
    del raw["tie_word_embeddings"]  # hand-written and older configs leave it out
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ref = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ours, _ = load_pretrained(tmp_path, ffn_path="dense", load_tokenizer=False)
    assert not ref.config.tie_word_embeddings and not ours.config.tie_word_embeddings
    ids = torch.tensor([[1, 5, 9, 20]])
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, ref(input_ids=ids).logits)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(ours.config, key) == getattr(ref.config, key), key
        assert getattr(ours.generation_config, key) == getattr(ref.generation_config, key), key
    # A tied checkpoint whose config leaves the key out has no lm_head to untie: it loads tied.
    tied = tmp_path / "tied"
    raw = _saved_plain_llama(tied, tie_word_embeddings=True)
    del raw["tie_word_embeddings"]
    (tied / "config.json").write_text(json.dumps(raw))
    ours, _ = load_pretrained(tied, ffn_path="dense", load_tokenizer=False)
    assert ours.config.tie_word_embeddings and ours.lm_head.weight is ours.model.embed_tokens.weight


def test_only_the_default_rope_is_loaded_however_the_config_spells_it():
    base = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": 4, "hidden_act": "relu"}
    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    for bad in ({"rope_parameters": llama3}, {"rope_theta": 5e5, "rope_parameters": llama3},
                {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}):
        with pytest.raises(ValueError, match="only the default RoPE"):
            from_hf_dict({**base, **bad})
    for fine in ({"rope_theta": 5e5}, {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
                 {"rope_theta": 5e5, "rope_scaling": {"rope_type": "default"}},
                 {"rope_theta": None, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}):
        assert from_hf_dict({**base, **fine})[0].rope_theta == 5e5
    no_width = {k: v for k, v in base.items() if k != "intermediate_size"}
    with pytest.raises(ValueError, match="intermediate_size"):
        from_hf_dict(no_width)


def test_set_ffn_path_and_tracking():
    mc = _random_cfg()
    model = build_model(mc).eval()
    with pytest.raises(ValueError, match="path must be one of"):
        set_ffn_path(model, "fast")
    silu = build_model(_random_cfg("silu_gated"))
    with pytest.raises(ValueError, match="layer 0"):
        set_ffn_path(silu, "reference")
    set_tracking(model, True)
    x = _ids(mc)
    with torch.no_grad():
        model(input_ids=x)
    for f in sparse_ffns(model):
        assert f.stats is not None and f.stats.active_per_token.shape == x.shape
    set_tracking(model, False)
    assert all(f.stats is None and not f.track for f in sparse_ffns(model))


def test_choose_union_paths_errors(monkeypatch):
    """Clear errors before any work: no SparseFFN layers, a bad share or rule, no kernels (the GPU
    behaviour is tested in tests/test_kernels.py)."""
    from twell import kernels
    from twell.model import choose_union_paths

    with pytest.raises(ValueError, match="no SparseFFN layers"):
        choose_union_paths(torch.nn.Linear(4, 4), torch.zeros(1, 4))
    mc = _random_cfg()
    model, ids = build_model(mc).eval(), _ids(mc)
    with pytest.raises(ValueError, match="min_share"):
        choose_union_paths(model, ids, min_share=1.5)
    with pytest.raises(ValueError, match="reps must be >= 1"):
        choose_union_paths(model, ids, reps=0)
    with pytest.raises(ValueError, match="min_gain"):
        choose_union_paths(model, ids, min_gain=1.0)
    with pytest.raises(ValueError, match="union"):
        choose_union_paths(model, ids, rule=(0.5, -1))
    monkeypatch.setattr(kernels, "available", lambda build=True: (False, "no CUDA device"))
    with pytest.raises(RuntimeError, match="needs the TwELL kernels: no CUDA device"):
        choose_union_paths(model, ids)
    assert all(f.union is None for f in sparse_ffns(model))  # nothing was changed


def test_reference_inference_path_matches_dense():
    """The sparse (TwELL reference, bf16) inference path gives the dense logits; the module says which path ran.

    Tolerance rule: the sparse path's error against fp32 is at most a small multiple of dense bf16's error.
    """
    mc = _random_cfg()
    mc.intermediate_size = 256 + random.randint(0, 40)
    model = build_model(mc).eval()
    x = _ids(mc)
    with torch.no_grad():
        set_ffn_path(model, "dense")
        ref = model(input_ids=x).logits
        cast_parameters(model, torch.bfloat16)
        dense = model(input_ids=x).logits.float()
        set_ffn_path(model, "reference")
        sparse = model(input_ids=x).logits.float()
    assert all(f.last_path == "twell-reference" for f in sparse_ffns(model))
    bf16_err = (dense - ref).abs().max().item()
    assert (sparse - ref).abs().max().item() <= 3 * bf16_err + 1e-3


def test_model_config_errors():
    with pytest.raises(ValueError, match="model.ffn"):
        ModelConfig(ffn="gelu")
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(hidden_size=30, num_heads=4)
    with pytest.raises(ValueError, match="unknown key"):
        ModelConfig.from_dict({"hidden": 3})
    with pytest.raises(TypeError, match="ModelConfig"):
        build_model(42)


def test_auto_activity_rule_on_a_twell():
    """The rule "auto" applies after its first kernel call (GPU test: test_kernels.py), on CPU TwELLs:
    above auto_max_active the layer goes dense with a note; path assignment measures again."""
    from twell import reference

    ffn = SparseFFN(64, 512)
    bf = torch.bfloat16
    busy = reference.twell_gate(torch.randn(32, 64, dtype=bf), torch.randn(512, 64, dtype=bf))  # ~50% active
    ffn._measure_activity(busy)
    assert ffn._auto_dense and "active per token" in ffn.auto_note
    ffn.path = "auto"
    assert ffn._auto_dense is None and ffn.auto_note is None
    quiet = reference.twell_gate(torch.zeros(32, 64, dtype=bf), torch.randn(512, 64, dtype=bf))  # none active
    ffn._measure_activity(quiet)
    assert ffn._auto_dense is False and ffn.auto_note is None


def test_checkpoint_without_tokenizer_files_names_its_hub_tokenizer(tmp_path, monkeypatch):
    """A checkpoint trained with a hub tokenizer that ships no tokenizer files, loaded offline: the
    error names the checkpoint and what to do there (not the data-preparation advice)."""
    model = build_model(_random_cfg()).eval()
    save_pretrained(model, None, tmp_path / "ck", tokenizer_choice={"kind": "hub", "name": "twell-tests/no-such-tok"})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match=r"ships no tokenizer files .* 'twell-tests/no-such-tok'.*load_tokenizer=False"):
        load_pretrained(tmp_path / "ck", ffn_path="dense")
    loaded, tok = load_pretrained(tmp_path / "ck", ffn_path="dense", load_tokenizer=False)
    assert tok is None and loaded.config.twell_tokenizer["name"] == "twell-tests/no-such-tok"


def test_saving_again_into_a_folder_leaves_no_earlier_shards(tmp_path):
    """A run re-exported into its final/ folder: a sharded save, then a single-file one, leaves one
    consistent checkpoint (no index naming shards that are gone)."""
    mc = _random_cfg()
    model = build_model(mc)
    save_pretrained(model, None, tmp_path, max_shard_size=2_000)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    save_pretrained(model, None, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]
    loaded, _ = load_pretrained(tmp_path, load_tokenizer=False)
    ids = _ids(mc)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model.eval()(input_ids=ids).logits)


def test_exported_token_ids_reach_generate(tmp_path):
    """A training export writes the data's eos/bos ids into config.json (extra_config); generate() reads
    generation_config.json, which must say the same. Older exports wrote the build-time ids
    there: a generation config derived from the model config is derived again from config.json."""
    mc = _random_cfg()
    model = build_model(mc)  # token ids 0, as a training run builds it
    model.generation_config.update(max_length=77, do_sample=True, top_k=5)  # a user's settings survive too
    save_pretrained(model, None, tmp_path, extra_config={"eos_token_id": 7, "bos_token_id": 7})
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == 7
    loaded, _ = load_pretrained(tmp_path, load_tokenizer=False)
    g = loaded.generation_config
    assert (g.eos_token_id, g.bos_token_id, g.max_length, g.do_sample, g.top_k) == (7, 7, 77, True, 5)
    assert model.generation_config.eos_token_id == 0  # the model itself is not changed
    # A checkpoint whose generation settings transformers' strict check would refuse (temperature without
    # sampling: only a warning while the config is left as loaded) still re-saves with new token ids.
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    gen.update(do_sample=False, temperature=0.6, top_k=None)
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    loaded, _ = load_pretrained(tmp_path, load_tokenizer=False)
    save_pretrained(loaded, None, tmp_path / "again", extra_config={"eos_token_id": 5})
    assert json.loads((tmp_path / "again" / "generation_config.json").read_text())["eos_token_id"] == 5
    stale = json.loads((tmp_path / "generation_config.json").read_text())
    stale.update(eos_token_id=0, bos_token_id=0, _from_model_config=True)
    (tmp_path / "generation_config.json").write_text(json.dumps(stale))
    loaded, _ = load_pretrained(tmp_path, load_tokenizer=False)
    assert loaded.generation_config.eos_token_id == 7
    save_pretrained(loaded, None, tmp_path / "third")  # the repaired config saves without complaint


def test_a_hub_generation_config_is_read_as_transformers_reads_it(tmp_path):
    """A generation_config.json derived from the model config and then edited (eos list, sampling
    settings): everything it says is kept; config.json's token ids are the same here."""
    _saved_plain_llama(tmp_path, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    gen.update(_from_model_config=True, eos_token_id=[2, 5], do_sample=True, temperature=0.6, top_p=0.9,
               max_length=4096)
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    ref = LlamaForCausalLM.from_pretrained(tmp_path).generation_config
    ours, _ = load_pretrained(tmp_path, ffn_path="dense", load_tokenizer=False)
    keys = ("do_sample", "temperature", "top_p", "max_length", "pad_token_id", "bos_token_id")
    assert {k: getattr(ours.generation_config, k) for k in keys} == {k: getattr(ref, k) for k in keys}


def test_load_pretrained_names_a_damaged_config(tmp_path):
    from twell.model import load_pretrained

    (tmp_path / "config.json").write_text('{"hidden_size": 64,\n')
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        load_pretrained(tmp_path)

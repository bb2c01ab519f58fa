"""Save and load Hugging Face checkpoints of twell models.

``save_pretrained`` writes a standard Llama checkpoint (safetensors + config.json + tokenizer):
plain ``transformers.AutoModelForCausalLM`` loads the ReLU-gated and SiLU variants and gives the
same logits. ``load_pretrained`` reads those, plain Llama checkpoints, the paper's released
checkpoints (``model_type: llama_sparse_relu``, Llama parameter keys) and the public ReLU checkpoints'
formats (ProSparse-Llama-2 and MiniCPM-S with FATReLU, ReluLLaMA, TurboSparse-Mistral with dReLU;
docs/models.md) and returns a model whose MLPs are SparseFFN modules. A FATReLU or dReLU model saves
with ``hidden_act`` naming its variant, which plain transformers refuses rather than computing ReLU; a
MiniCPM model does not save (its scaling is not a Llama's).

The non-gated ``relu`` variant has no ``gate_proj``; plain transformers cannot express it, so
only ``load_pretrained`` loads it (config.json says ``twell_ffn: relu``).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from twell.model.config import TOKEN_IDS, from_hf_dict
from twell.model.llama import build_model, cast_parameters, set_ffn_path, sparse_ffns

# Keys the paper's training code may leave in a state dict that carry no weights.
_AUX_KEY_PARTS = ("tracker.", "metrics_accumulator.", "rotary_emb.inv_freq")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}



def _read_json(path: Path) -> dict:
    """A checkpoint's JSON file; a damaged one raises ValueError naming it."""
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None

def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A torch dtype from a torch.dtype or a name (``"bfloat16"``/``"bf16"``/``"float32"``/...).

    ``None`` and ``"auto"`` give None (keep the stored / default dtype).
    """
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"unknown dtype {dtype!r}; expected a torch.dtype, 'auto' or one of {sorted(_DTYPES)}")


def save_pretrained(model: nn.Module, tokenizer, path: str | Path, max_shard_size: int | str = "2GB", *,
                    dtype: torch.dtype | str | None = None, tokenizer_choice: dict | None = None,
                    extra_config: dict | None = None) -> Path:
    """Write ``model`` (+ ``tokenizer`` when given) as a Hugging Face checkpoint directory.

    dtype: cast weights on the way out (e.g. ``torch.bfloat16``); the model itself is not changed.
    tokenizer_choice: how the tokenizer was chosen (hub id or trained); stored in config.json as
    ``twell_tokenizer``. Tied ``lm_head.weight`` is stored once, as transformers does.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = resolve_dtype(dtype)
    if not hasattr(model, "save_pretrained") or not hasattr(model, "config"):
        raise TypeError(f"expected a transformers LlamaForCausalLM, got {type(model).__name__}")
    if getattr(model.config, "scale_emb", None) is not None:
        raise ValueError("save_pretrained writes Llama checkpoints; this model computes MiniCPM's scaling "
                         "(scale_emb, scale_depth, dim_model_base), which plain transformers would ignore and "
                         "MiniCPM's own code is not part of this package: keep the original checkpoint")
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {}
    for k, v in model.state_dict().items():
        if tied and k == "lm_head.weight":
            continue
        v = v.detach()
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        state[k] = v.contiguous().cpu()
    saved_cfg = model.config
    cfg = copy.deepcopy(saved_cfg)
    out_dtype = dtype or next(model.parameters()).dtype
    cfg.use_cache = True  # a generation default for whoever loads it; training never uses the cache
    if tokenizer_choice is not None:
        cfg.twell_tokenizer = dict(tokenizer_choice)
    for k, v in (extra_config or {}).items():
        setattr(cfg, k, v)
    model.config = cfg
    # An earlier save's shards and index would sit beside this one's (a sharded index pointing at deleted
    # shards next to a new single file): loaders that read the index would break.
    for pattern in ("model*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin",
                    "pytorch_model.bin.index.json"):
        for old_file in path.glob(pattern):
            old_file.unlink()
    try:
        model.save_pretrained(str(path), state_dict=state, max_shard_size=max_shard_size)
    finally:
        model.config = saved_cfg
    # generation_config.json must name the token ids config.json now has (generate() stops on its eos).
    # Patched in the file: editing the object would make transformers validate all of it strictly.
    gen_file = path / "generation_config.json"
    ids = {k: v for k, v in (extra_config or {}).items() if k in TOKEN_IDS}
    if ids and gen_file.is_file():
        gen = json.loads(gen_file.read_text())
        gen.update(ids)
        gen_file.write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    # transformers writes the dtype of the live parameters; record the dtype actually stored.
    cfg_file = path / "config.json"
    written = json.loads(cfg_file.read_text())
    name = str(out_dtype).replace("torch.", "")
    for key in [k for k in ("dtype", "torch_dtype") if k in written] or ["dtype"]:
        written[key] = name
    cfg_file.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path


def _resolve_dir(path_or_hub_id: str | Path, allow_network: bool | None) -> Path:
    p = Path(path_or_hub_id).expanduser()
    if p.is_dir():
        return p
    s = str(path_or_hub_id)
    if p.exists() or s.startswith((".", "/", "~")) or s.count("/") != 1:
        raise FileNotFoundError(f"expected a checkpoint directory or a hub id 'owner/name', got {s!r} (no such directory)")
    owner = s.split("/")[0]
    if Path(owner).is_dir():  # "runs/final" with ./runs present: a missing local checkpoint, not a hub id
        raise FileNotFoundError(f"no checkpoint directory {s!r} (relative to {Path.cwd()}); not tried as a hub id "
                                f"because ./{owner} is a local folder (pass an absolute path or fix the name)")
    from huggingface_hub import snapshot_download

    from twell.data.network import network_allowed

    # An explicit hub id may download by default; TWELL_ALLOW_NETWORK, when set, decides as everywhere else.
    env_says = os.environ.get("TWELL_ALLOW_NETWORK", "").strip() != ""
    online = network_allowed(allow_network if allow_network is not None or env_says else True)
    small = ["*.json", "tokenizer*", "*.model", "*.txt", "*.tiktoken"]
    try:
        local = Path(snapshot_download(s, local_files_only=not online, allow_patterns=small + ["*.safetensors"]))
        if not any(local.glob("*.safetensors")):  # an older repository with PyTorch .bin weights only
            local = Path(snapshot_download(s, local_files_only=not online, allow_patterns=small + ["*.bin"]))
    except Exception as exc:  # offline without a cached copy, unknown repo, ...
        how = "online" if online else "from the local Hugging Face cache only (offline: HF_*_OFFLINE set or network not allowed)"
        raise FileNotFoundError(f"could not get checkpoint {s!r} {how}: {type(exc).__name__}: {exc}") from exc
    return local


def read_state_dict(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (safetensors, sharded or not; else pytorch_model*.bin)."""
    d = Path(ckpt_dir)
    files: list[Path] = []
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (d / index_name).is_file():
            weight_map = _read_json(d / index_name)["weight_map"]
            files = [d / f for f in sorted(set(weight_map.values()))]
            break
    if not files:
        files = sorted(d.glob("*.safetensors")) or sorted(d.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"no weights in {d}: expected model.safetensors, sharded safetensors or pytorch_model.bin")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"checkpoint index names {f.name}, which is missing from {d}")
        if f.suffix == ".safetensors":
            from safetensors.torch import load_file

            state.update(load_file(str(f)))
        else:
            state.update(torch.load(f, map_location="cpu", weights_only=True))
    return state


def load_pretrained(path_or_hub_id: str | Path, ffn_path: str = "auto", device=None, dtype=None, *,
                    allow_network: bool | None = None, load_tokenizer: bool = True):
    """(model, tokenizer) from a checkpoint directory or hub id.

    The model is a ``LlamaForCausalLM`` whose MLPs are SparseFFN modules (ReLU: sparse-capable,
    ``ffn_path`` sets their inference path; SiLU: dense). ``tokenizer`` is None when the
    checkpoint ships none. ``model.config.twell_tokenizer`` records which tokenizer the model
    was trained with (or, for foreign checkpoints, where the tokenizer came from).
    A hub id is downloaded unless an HF_*_OFFLINE variable is set, ``allow_network=False``, or
    ``TWELL_ALLOW_NETWORK`` is set to a false value (0, off, ...). A missing path whose first part is a
    local folder ("runs/final" beside ./runs) is reported as missing, never looked up on the hub.
    """
    ckpt = _resolve_dir(path_or_hub_id, allow_network)
    cfg_path = ckpt / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{ckpt} has no config.json; expected a Hugging Face checkpoint directory")
    raw = _read_json(cfg_path)
    mc, notes = from_hf_dict(raw)
    # the checkpoint's own token ids as written (a list of eos ids, a pad id, null), as transformers keeps them
    extra = {k: raw[k] for k in ("twell_tokenizer", *TOKEN_IDS) if k in raw}
    if notes:
        extra["twell_converted_from"] = notes.get("converted_from")
    state = read_state_dict(ckpt)
    state = {k: v for k, v in state.items() if not any(part in k for part in _AUX_KEY_PARTS)}
    if "tie_word_embeddings" not in raw and "lm_head.weight" not in state:
        # transformers' default is untied, but without an lm_head the checkpoint can only mean tied
        mc = dataclasses.replace(mc, tie_embeddings=True)
    with torch.device("meta"):  # no random initialisation of weights that are replaced right away
        model = build_model(mc, **extra)
    if mc.tie_embeddings:
        state.pop("lm_head.weight", None)
    if raw.get("model_type") == "bamboo":
        # TurboSparse's activity predictors (mlp.predictor.*) only guess which neurons fire; the exact
        # computation does not need them
        state = {k: v for k, v in state.items() if ".mlp.predictor." not in k}
    expected = set(model.state_dict())
    if mc.tie_embeddings:
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {ckpt} does not match a {mc.num_layers}-layer {mc.ffn} Llama: "
            f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
    ref = model.state_dict()
    bad = [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(ref[k].shape)}" for k, v in state.items()
           if tuple(v.shape) != tuple(ref[k].shape)]
    if bad:
        raise ValueError(f"checkpoint {ckpt} has tensors of the wrong shape: {bad[:4]}")
    model.load_state_dict(state, strict=False, assign=True)
    if mc.tie_embeddings:
        model.tie_weights()
        if model.lm_head.weight is not model.model.embed_tokens.weight:
            raise RuntimeError("tied embeddings were untied while loading; refusing to return an inconsistent model")
    _rebuild_meta_buffers(model)
    if (ckpt / "generation_config.json").is_file():  # as from_pretrained does: generate() stops where it should
        from transformers import GenerationConfig

        gen = _read_json(ckpt / "generation_config.json")
        if gen.get("_from_model_config"):
            # Derived from the model config: its token ids follow config.json, where that names them
            # (older exports wrote the build-time ids, 0, here and the data's in config.json).
            # Set before the object is made: an object edited afterwards is validated strictly on save.
            gen.update({k: raw[k] for k in TOKEN_IDS if raw.get(k) is not None})
        gen = GenerationConfig.from_dict(gen)
        gen._original_object_hash = hash(gen)  # as from_pretrained marks it: loaded, not edited
        model.generation_config = gen
    dtype = resolve_dtype(dtype)
    if dtype is None:
        saved = raw.get("dtype") or raw.get("torch_dtype")
        dtype = (_DTYPES.get(saved) if isinstance(saved, str) else None) or torch.float32  # as built before
    cast_parameters(model, dtype)
    if device is not None:
        model.to(device)
    if mc.sparse:
        set_ffn_path(model, ffn_path)
    elif ffn_path not in ("auto", "dense"):
        raise ValueError(f"ffn_path={ffn_path!r} needs ReLU MLPs; this checkpoint's MLPs use {mc.activation}")
    model.eval()

    tokenizer = None
    if load_tokenizer:
        tokenizer = _load_tokenizer(ckpt, raw, allow_network)
        if "twell_tokenizer" not in raw:
            model.config.twell_tokenizer = {"kind": "checkpoint" if tokenizer is not None else "none",
                                            "name": str(path_or_hub_id)}
    assert sparse_ffns(model), "build_model always installs SparseFFN modules"
    return model, tokenizer


def _rebuild_meta_buffers(model: torch.nn.Module) -> None:
    """Recompute the buffers a checkpoint does not hold (RoPE inverse frequencies) after a meta-device build.

    Rotary modules are rebuilt on the CPU from the model config (fp32, as transformers computes them);
    anything else still on the meta device is an error, never a silently empty tensor.
    """
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding") and any(b.is_meta for b in module.buffers()):
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            setattr(parent, name.rpartition(".")[2], type(module)(config=model.config))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left uninitialised after loading (not in the checkpoint): {left[:6]}")


def _load_tokenizer(ckpt: Path, raw: dict[str, Any], allow_network: bool | None):
    from transformers import AutoTokenizer

    if any((ckpt / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return AutoTokenizer.from_pretrained(str(ckpt))
    choice = raw.get("twell_tokenizer") or {}
    if choice.get("kind") == "hub" and choice.get("name"):
        from twell.data.tokenizer import load_hub_tokenizer

        try:
            return load_hub_tokenizer(choice["name"], allow_network=allow_network)
        except RuntimeError as exc:  # its advice (data.tokenizer=train) is for preparing data, not loading
            raise RuntimeError(f"{ckpt} ships no tokenizer files and was trained with the hub tokenizer "
                               f"{choice['name']!r}, which is not in the local Hugging Face cache: allow the "
                               "network (allow_network=True or TWELL_ALLOW_NETWORK=1, HF_*_OFFLINE unset), copy "
                               "the tokenizer files into the checkpoint, or pass load_tokenizer=False") from exc
    warnings.warn(f"{ckpt} ships no tokenizer files; returning tokenizer=None", stacklevel=3)
    return None

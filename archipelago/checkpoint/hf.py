"""Hugging Face model directories in and out: config.json + safetensors, transformers' names.

`read_hf_weights` turns a directory as `huggingface-cli download` leaves it (one
`model.safetensors`, or shards with `model.safetensors.index.json`) into a state dict of
our parameter names, after checking its config.json against the flavor the run chose
(`HFMismatch` names every differing field). `write_hf` writes the other way: our state
dict under transformers' names, `config.json`, `generation_config.json`, and the
tokenizer, which `transformers.AutoModelForCausalLM.from_pretrained` loads with the same
outputs (tests/test_hf.py checks both directions against transformers).

No transformers at run time: the names and config fields are written out here. Both
transformers' current RoPE fields (`rope_parameters`) and the older ones (`rope_theta`,
`rope_scaling`) are read, and both are written. safetensors holds raw tensors only (no
pickle), so a downloaded directory cannot run code when it is read.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from archipelago.models.args import ModelArgs, RopeScaling
from archipelago.models.gpt_oss import GptOssArgs, YarnScaling

# family -> (config.json model_type, architecture class)
HF_FAMILIES = {"llama3": ("llama", "LlamaForCausalLM"), "qwen3": ("qwen3", "Qwen3ForCausalLM"),
               "gpt_oss": ("gpt_oss", "GptOssForCausalLM")}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_BLOCK_NAMES = {  # ours (under layers.N.) -> transformers' (under model.layers.N.)
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}


_GPT_OSS_NAMES = {  # ours (under layers.N.) -> transformers' (under model.layers.N.)
    "attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.sinks": "self_attn.sinks",
    "moe.router.weight": "mlp.router.weight", "moe.router.bias": "mlp.router.bias",
    "moe.experts.gate_up": "mlp.experts.gate_up_proj", "moe.experts.gate_up_bias": "mlp.experts.gate_up_proj_bias",
    "moe.experts.down": "mlp.experts.down_proj", "moe.experts.down_bias": "mlp.experts.down_proj_bias",
    **{f"attention.{ours}.{kind}": f"self_attn.{theirs}.{kind}" for ours, theirs in
       (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")) for kind in ("weight", "bias")},
}

Args = ModelArgs | GptOssArgs


class HFMismatch(ValueError):
    """A Hugging Face directory that does not hold the chosen model."""


def hf_names(args: Args) -> dict[str, str]:
    """Our parameter name -> transformers' name, for every parameter the model saves
    (a tied output layer is the embedding, saved once)."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not args.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    if isinstance(args, GptOssArgs):
        for i in range(args.n_layers):
            names.update({f"layers.{i}.{a}": f"model.layers.{i}.{b}" for a, b in _GPT_OSS_NAMES.items()})
        return names
    for i in range(args.n_layers):
        for ours, theirs in _BLOCK_NAMES.items():
            if "_norm" in ours and ours.startswith("attention.") and not args.qk_norm:
                continue
            names[f"layers.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    return names


def hf_config(family: str, args: Args, dtype: str = "float32", eos_token_id: int | None = None,
              bos_token_id: int | None = None) -> dict[str, Any]:
    """transformers' config.json for `args` of `family`."""
    model_type, architecture = _family(family)
    if isinstance(args, GptOssArgs):
        return _gpt_oss_config(args, architecture, dtype, eos_token_id, bos_token_id)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling is not None:
        s = args.rope_scaling
        rope = {"rope_type": "llama3", "rope_theta": args.rope_theta, "factor": s.factor,
                "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_seq_len}
    config: dict[str, Any] = {
        "architectures": [architecture], "model_type": model_type, "vocab_size": args.vocab_size,
        "hidden_size": args.dim, "intermediate_size": args.ffn_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "max_position_embeddings": args.max_seq_len, "rms_norm_eps": args.norm_eps, "hidden_act": "silu",
        "tie_word_embeddings": args.tie_embeddings, "attention_bias": False, "attention_dropout": 0.0,
        "rope_parameters": rope, "rope_theta": args.rope_theta,  # the second for older readers
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "dtype": dtype, "use_cache": True,
    }
    if args.rope_scaling is not None:
        config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if family == "llama3":
        config["mlp_bias"] = False
    return config


def _gpt_oss_config(args: GptOssArgs, architecture: str, dtype: str, eos_token_id: int | None,
                    bos_token_id: int | None) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.yarn is not None:
        y = args.yarn
        rope.update(rope_type="yarn", factor=y.factor, beta_fast=y.beta_fast, beta_slow=y.beta_slow, truncate=False,
                    original_max_position_embeddings=y.original_max_seq_len)
    return {
        "architectures": [architecture], "model_type": "gpt_oss", "vocab_size": args.vocab_size,
        "hidden_size": args.dim, "intermediate_size": args.ffn_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "num_local_experts": args.n_experts, "num_experts_per_tok": args.top_k, "sliding_window": args.sliding_window,
        "layer_types": ["sliding_attention" if k % 2 == 0 else "full_attention" for k in range(args.n_layers)],
        "max_position_embeddings": args.max_seq_len, "rms_norm_eps": args.norm_eps, "rope_parameters": rope,
        "swiglu_limit": args.swiglu_limit, "attention_bias": True, "tie_word_embeddings": args.tie_embeddings,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "dtype": dtype, "use_cache": True,
    }


def _gpt_oss_fields(config: dict[str, Any]) -> dict[str, Any]:
    if config.get("quantization_config"):  # the published checkpoints store experts in MXFP4 blocks
        raise HFMismatch("config.json describes quantized (MXFP4) experts; save a dequantized copy first "
                         "(transformers: from_pretrained with Mxfp4Config(dequantize=True), then save_pretrained)")
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    yarn = None
    if rope.get("rope_type", "default") == "yarn":
        yarn = YarnScaling(float(rope["factor"]), float(rope.get("beta_fast", 32.0)),
                           float(rope.get("beta_slow", 1.0)), int(rope["original_max_position_embeddings"]))
    layer_types = config.get("layer_types")
    layers = int(config["num_hidden_layers"])
    expected = ["sliding_attention" if k % 2 == 0 else "full_attention" for k in range(layers)]
    if layer_types is not None and list(layer_types) != expected:
        raise HFMismatch("config.json's layer_types are not sliding/full alternating from layer 0, as gpt_oss has")
    return {
        "dim": int(config["hidden_size"]), "n_layers": int(config["num_hidden_layers"]),
        "n_heads": int(config["num_attention_heads"]), "n_kv_heads": int(config["num_key_value_heads"]),
        "head_dim": int(config["head_dim"]), "vocab_size": int(config["vocab_size"]),
        "ffn_dim": int(config["intermediate_size"]), "n_experts": int(config["num_local_experts"]),
        "top_k": int(config["num_experts_per_tok"]), "sliding_window": int(config["sliding_window"]),
        "norm_eps": float(config["rms_norm_eps"]), "rope_theta": float(rope.get("rope_theta", 150000.0)),
        "yarn": yarn, "swiglu_limit": float(config.get("swiglu_limit", 7.0)),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
    }


def args_from_hf_config(config: dict[str, Any], family: str) -> dict[str, Any]:
    """The ModelArgs fields a transformers config.json describes (HFMismatch when it is not
    a `family` model or uses what our models do not have)."""
    model_type, _ = _family(family)
    if config.get("model_type") != model_type:
        raise HFMismatch(f"config.json is a {config.get('model_type')!r} model, not {model_type!r} ({family})")
    if family == "gpt_oss":
        return _gpt_oss_fields(config)
    for unsupported in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if config.get(unsupported):
            raise HFMismatch(f"config.json sets {unsupported} = true, which {family} does not have")
    heads = int(config["num_attention_heads"])
    rope = dict(config.get("rope_parameters") or {})
    legacy = dict(config.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", legacy.get("rope_type", legacy.get("type", "default")))
    scaling = None
    if kind == "llama3":
        source = rope if rope.get("rope_type") == "llama3" else legacy
        scaling = RopeScaling(float(source["factor"]), float(source["low_freq_factor"]),
                              float(source["high_freq_factor"]), int(source["original_max_position_embeddings"]))
    elif kind != "default":
        raise HFMismatch(f"config.json uses {kind!r} RoPE scaling; {family} knows default and llama3")
    return {
        "dim": int(config["hidden_size"]), "n_layers": int(config["num_hidden_layers"]), "n_heads": heads,
        "n_kv_heads": int(config.get("num_key_value_heads") or heads),
        "head_dim": int(config.get("head_dim") or int(config["hidden_size"]) // heads),
        "vocab_size": int(config["vocab_size"]), "ffn_dim": int(config["intermediate_size"]),
        "norm_eps": float(config["rms_norm_eps"]), "rope_theta": theta, "rope_scaling": scaling,
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
    }


def check_hf_config(config: dict[str, Any], family: str, args: Args) -> None:
    """HFMismatch naming every field where the directory's model differs from `args`."""
    theirs = args_from_hf_config(config, family)
    differing = [f"{name}: {value!r} in config.json, {getattr(args, name)!r} in the flavor"
                 for name, value in theirs.items() if getattr(args, name) != value]
    if differing:
        raise HFMismatch("the Hugging Face model is not the chosen flavor: " + "; ".join(differing)
                         + " (pick the flavor of that shape, or a matching tokenizer for vocab_size)")


def read_hf_config(folder: Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise HFMismatch(f"{folder} holds no config.json: not a Hugging Face model directory")
    config = json.loads(path.read_text())
    if not isinstance(config, dict):
        raise HFMismatch(f"{path} is not a JSON object")
    return config


def _weight_files(folder: Path) -> dict[str, Path]:
    """transformers' tensor name -> the safetensors file holding it."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise HFMismatch(f"{index} has no weight_map")
        files = {name: (folder / str(file)) for name, file in weight_map.items()}
        for path in set(files.values()):
            if path.parent.resolve() != folder.resolve():
                raise HFMismatch(f"{index} points outside the directory: {path}")
        return files
    single = folder / SINGLE_FILE
    if not single.is_file():
        raise HFMismatch(f"{folder} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 - safe_open has no iterator


def read_hf_weights(folder: str | Path, family: str, args: Args) -> dict[str, torch.Tensor]:
    """Our state dict (float32, CPU; every key of the model's state_dict) from a Hugging
    Face directory of a `family` model of shape `args`; only the files holding the
    tensors the model needs are opened."""
    folder = Path(folder)
    check_hf_config(read_hf_config(folder), family, args)
    names = hf_names(args)
    files = _weight_files(folder)
    missing = [theirs for theirs in names.values() if theirs not in files]
    if missing:
        raise HFMismatch(f"{folder}: {len(missing)} tensor(s) missing, e.g. {', '.join(missing[:3])}")
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for ours, theirs in names.items():
        by_file.setdefault(files[theirs], []).append((ours, theirs))
    state: dict[str, torch.Tensor] = {}
    for path, pairs in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for ours, theirs in pairs:
                state[ours] = f.get_tensor(theirs).float()
    if args.tie_embeddings:  # one tensor under both of the model's names, as its state_dict has them
        state["output.weight"] = state["tok_embeddings.weight"]
    return state


def read_hf_tensors(folder: str | Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face directory's safetensors (float32, CPU), names prefixed:
    for the hf family, whose parameters are transformers' own under `hf.`."""
    state: dict[str, torch.Tensor] = {}
    files = _weight_files(Path(folder))
    for path in sorted(set(files.values())):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no iterator
                state[prefix + name] = f.get_tensor(name).float()
    return state


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    shard: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > max_bytes:
            yield shard
            shard, size = {}, 0
        shard[name] = t
        size += nbytes
    if shard:
        yield shard


def write_hf(out: str | Path, family: str, args: Args, state: dict[str, torch.Tensor],
             dtype: str = "float32", tokenizer: Path | None = None, eos_token_id: int | None = None,
             max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write `state` (our names) as a transformers directory `out` and return it."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {theirs: state[ours].detach().to("cpu", DTYPES[dtype]).contiguous()
               for ours, theirs in hf_names(args).items()}
    shards = list(_shards(tensors, max_shard_bytes))
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE_FILE), metadata={"format": "pt"})
    else:
        weight_map = {}
        for k, shard in enumerate(shards, 1):
            name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2))
    config = hf_config(family, args, dtype, eos_token_id=eos_token_id)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"eos_token_id": eos_token_id, "max_length": args.max_seq_len}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    if tokenizer is not None:
        shutil.copyfile(tokenizer, out / "tokenizer.json")
    return out


def _family(family: str) -> tuple[str, str]:
    if family not in HF_FAMILIES:
        raise HFMismatch(f"no Hugging Face mapping for the {family!r} family; families with one: "
                         f"{', '.join(HF_FAMILIES)}")
    return HF_FAMILIES[family]

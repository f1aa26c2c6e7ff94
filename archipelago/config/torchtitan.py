"""Run files in torchtitan's format (what the reference platform's users have): recognised
and mapped key by key onto our schema.

A file is taken as torchtitan's when it has a key only torchtitan's format has
(`[training] local_batch_size`, `[parallelism] data_parallel_shard_degree`,
`[job] dump_folder`, ...). Each key either maps onto one of ours, is listed in one warning
(no equivalent here, and the run means the same without it: profiling, float8 switches
that are off, ...), or stops the load with an error naming the fix when dropping it would
change what the run computes (tensor or context parallelism, an unknown optimizer or
schedule shape). `archipelago config convert FILE` prints the result as our TOML.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from archipelago.config.errors import ConfigError

# Keys that exist in torchtitan's format and not in ours: any one of them marks a file as torchtitan's.
MARKERS = {("training", "local_batch_size"), ("training", "global_batch_size"), ("training", "dataset"),
           ("job", "dump_folder"), ("parallelism", "data_parallel_shard_degree"),
           ("parallelism", "tensor_parallel_degree"), ("metrics", "log_freq"), ("metrics", "enable_tensorboard"),
           ("checkpoint", "enable_checkpoint"), ("model", "hf_assets_path"), ("activation_checkpoint", "mode"),
           ("lr_scheduler", "decay_type"), ("training", "mixed_precision_param")}

# torchtitan's (model, flavor) names that differ from ours; other flavors keep their name.
MODELS = {("qwen3", "debugmodel_moe"): ("qwen3_moe", "debug")}
FLAVORS = {"debugmodel": "debug"}
# torchtitan's defaults where they differ from ours, so an absent key means what it means
# there (its JobConfig); only keys that map onto ours.
DEFAULTS: dict[str, dict[str, Any]] = {
    "model": {"name": "llama3", "flavor": "debugmodel"},
    "optimizer": {"name": "AdamW", "lr": 8e-4, "eps": 1e-8, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95},
    "lr_scheduler": {"warmup_steps": 200, "decay_type": "linear", "min_lr_factor": 0.0},
    "training": {"local_batch_size": 8, "seq_len": 2048, "max_norm": 1.0, "steps": 10000},
    "checkpoint": {"enable": False, "folder": "checkpoint", "interval": 500, "keep_latest_k": 10},
    "metrics": {"log_freq": 10, "enable_tensorboard": False},
    "validation": {"enable": False, "freq": 10},
    "activation_checkpoint": {"mode": "selective"},
}
OPTIMIZERS = {"adamw": "adamw", "sgd": "sgd"}
DECAYS = {"linear": "linear", "cosine": "cosine"}
SCHEDULES = {"1f1b": "1f1b", "gpipe": "gpipe", "interleaved1f1b": "interleaved_1f1b"}
PRECISIONS = {"bfloat16": "bf16", "float32": "fp32"}
# [fault_tolerance] keys spelled the same in both formats.
FAULT_TOLERANCE_SAME = ("enable", "replica_id", "group_size", "min_replica_size", "semi_sync_method", "sync_steps",
                        "should_quantize", "fragment_sync_delay", "fragment_update_alpha", "num_fragments",
                        "process_group", "process_group_timeout_ms")


@dataclass
class Conversion:
    """Our TOML document, and torchtitan's keys that have no equivalent here."""

    ours: dict[str, dict[str, Any]] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)

    def put(self, section: str, key: str, value: Any) -> None:
        self.ours.setdefault(section, {})[key] = value

    def warning(self, source: str) -> str | None:
        if not self.dropped:
            return None
        return (f"{source}: torchtitan-format file, mapped onto Archipelago's keys (`archipelago config convert` "
                f"prints the result); left out, with no equivalent here: {', '.join(self.dropped)}")


def is_torchtitan(raw: dict[str, Any]) -> bool:
    """Whether a parsed TOML document is in torchtitan's format."""
    return any(isinstance(raw.get(s), dict) and k in raw[s] for s, k in MARKERS)


def _choice(table: dict[str, str], value: Any, where: str, fix: str) -> str:
    key = str(value).lower().replace("_", "").replace("-", "") if table is SCHEDULES else str(value).lower()
    if key not in table:
        raise ConfigError(f"{where} = {value!r} has no equivalent here ({', '.join(table)}): {fix}")
    return table[key]


def _data_parallel_degree(par: dict[str, Any], ranks: int) -> int:
    """Ranks that read different data: shard x replicate degree (-1: all ranks not used otherwise)."""
    pp = max(1, int(par.get("pipeline_parallel_degree", 1)))
    shard = int(par.get("data_parallel_shard_degree", -1))
    replicate = max(1, int(par.get("data_parallel_replicate_degree", 1)))
    if shard == -1:
        shard = max(1, ranks // (pp * replicate))
    return shard * replicate


def _refuse_degree(par: dict[str, Any], key: str, what: str) -> None:
    if int(par.get(key, 1)) > 1:
        raise ConfigError(f"parallelism.{key} = {par[key]}: {what} is not available here and the run would not "
                          f"fit or mean the same without it; set it to 1 (each island shards with FSDP, or "
                          "pipelines with pipeline_parallel_degree)")


def _parallelism(par: dict[str, Any], training: dict[str, Any], out: Conversion, ranks: int) -> None:
    _refuse_degree(par, "tensor_parallel_degree", "tensor parallelism")
    _refuse_degree(par, "context_parallel_degree", "context parallelism")
    _refuse_degree(par, "expert_tensor_parallel_degree", "tensor parallelism of the experts")
    shard, replicate = int(par.get("data_parallel_shard_degree", -1)), int(par.get("data_parallel_replicate_degree", 1))
    out.put("parallelism", "data_parallel", "ddp" if shard == 1 and replicate > 1 else "fsdp")
    stages = int(par.get("pipeline_parallel_degree", 1))
    if stages > 1:
        out.put("parallelism", "pipeline_stages", stages)
        schedule = _choice(SCHEDULES, par.get("pipeline_parallel_schedule", "1F1B"),
                           "parallelism.pipeline_parallel_schedule", "use 1F1B, GPipe or Interleaved1F1B")
        out.put("parallelism", "pipeline_schedule", schedule)
        if schedule == "interleaved_1f1b":
            out.put("parallelism", "stages_per_rank", 2)
        size = int(par.get("pipeline_parallel_microbatch_size", 1))
        local = int(training.get("local_batch_size", 8))
        out.put("parallelism", "pipeline_micro_batches", max(stages, local // max(1, size)))
    if int(par.get("expert_parallel_degree", 1)) > 1:
        out.put("parallelism", "expert_parallel", True)
    handled = {"tensor_parallel_degree", "context_parallel_degree", "data_parallel_shard_degree",
               "data_parallel_replicate_degree", "pipeline_parallel_degree", "pipeline_parallel_schedule",
               "pipeline_parallel_microbatch_size", "expert_parallel_degree", "expert_tensor_parallel_degree"}
    out.dropped += [f"parallelism.{k}" for k in par if k not in handled]


def _training(t: dict[str, Any], par: dict[str, Any], out: Conversion, ranks: int) -> None:
    if int(t.get("global_batch_size", -1)) > 0:
        out.put("training", "batch_size", int(t["global_batch_size"]))
    elif "local_batch_size" in t or "batch_size" in t:
        local = int(t.get("local_batch_size", t.get("batch_size", 8)))
        out.put("training", "batch_size", local * _data_parallel_degree(par, ranks))
    simple = {"steps": ("training", "steps"), "max_norm": ("training", "max_norm"), "seed": ("training", "seed"),
              "seq_len": ("data", "seq_len"), "compile": ("training", "compile"), "dataset_path": ("data", "path")}
    for key, (section, ours) in simple.items():
        if key in t:
            out.put(section, ours, t[key])
    if "mixed_precision_param" in t:
        out.put("training", "mixed_precision", _choice(PRECISIONS, t["mixed_precision_param"],
                                                       "training.mixed_precision_param", "use bfloat16 or float32"))
    if "dataset" in t and "dataset_path" not in t:  # a hub dataset name (c4, c4_test): nothing is downloaded here
        out.dropped.append(f"training.dataset ({t['dataset']}: no hub downloads; the text is data.path, "
                           "else the Shakespeare corpus)")
    handled = {"global_batch_size", "local_batch_size", "batch_size", "mixed_precision_param", "dataset", *simple}
    out.dropped += _flat_keys("training", {k: v for k, v in t.items() if k not in handled})


def _model(m: dict[str, Any], out: Conversion) -> None:
    name, flavor = MODELS.get((m["name"], m["flavor"]), (m["name"], FLAVORS.get(m["flavor"], m["flavor"])))
    out.put("model", "name", name)
    out.put("model", "flavor", flavor)
    assets = m.get("hf_assets_path") or m.get("tokenizer_path")
    if assets and (Path(assets) / "tokenizer.json").is_file():
        out.put("data", "tokenizer", str(Path(assets) / "tokenizer.json"))
    elif assets:
        out.dropped.append(f"model.hf_assets_path ({assets}: no tokenizer.json there; a tokenizer is trained "
                           "on the data)")
    out.dropped += [f"model.{k}" for k in m if k not in {"name", "flavor", "hf_assets_path", "tokenizer_path"}]


def _optimizer(o: dict[str, Any], out: Conversion) -> None:
    if "name" in o:
        out.put("optimizer", "name", _choice(OPTIMIZERS, o["name"], "optimizer.name", "use AdamW or SGD"))
    for key in ("lr", "eps", "weight_decay", "beta1", "beta2", "momentum"):
        if key in o:
            out.put("optimizer", key, o[key])
    out.dropped += [f"optimizer.{k}" for k in o
                    if k not in {"name", "lr", "eps", "weight_decay", "beta1", "beta2", "momentum"}]


def _lr_scheduler(s: dict[str, Any], out: Conversion) -> None:
    if "warmup_steps" in s:
        out.put("lr_scheduler", "warmup_steps", s["warmup_steps"])
    if "decay_type" in s:
        out.put("lr_scheduler", "decay", _choice(DECAYS, s["decay_type"], "lr_scheduler.decay_type",
                                                 "use linear or cosine"))
    if "min_lr_factor" in s:
        out.put("lr_scheduler", "min_lr_ratio", s["min_lr_factor"])
    if "decay_ratio" in s:
        out.dropped.append(f"lr_scheduler.decay_ratio ({s['decay_ratio']}: no constant phase here; the decay "
                           "starts after the warmup)")
    known = {"warmup_steps", "decay_type", "min_lr_factor", "decay_ratio"}
    out.dropped += [f"lr_scheduler.{k}" for k in s if k not in known]


def _checkpoint(c: dict[str, Any], out: Conversion) -> None:
    enable = c.get("enable_checkpoint", c.get("enable"))
    if enable is not None:
        out.put("checkpoint", "enable", enable)
    same = {"folder": "folder", "interval": "interval", "keep_latest_k": "keep",
            "initial_load_path": "initial_load_path"}
    for key, ours in same.items():
        if key in c:
            out.put("checkpoint", ours, c[key])
    out.dropped += [f"checkpoint.{k}" for k in c if k not in {"enable_checkpoint", "enable", *same}]


def _job(j: dict[str, Any], out: Conversion) -> None:
    if "dump_folder" in j:
        out.put("job", "run_dir", j["dump_folder"])
    out.dropped += [f"job.{k}" for k in j if k != "dump_folder"]


def _metrics(m: dict[str, Any], out: Conversion) -> None:
    if "log_freq" in m:
        out.put("metrics", "log_every", m["log_freq"])
    if "enable_tensorboard" in m:
        out.put("metrics", "tensorboard", m["enable_tensorboard"])
    out.dropped += [f"metrics.{k}" for k in m if k not in {"log_freq", "enable_tensorboard"}]


def _activation_checkpoint(a: dict[str, Any], out: Conversion) -> None:
    mode = str(a.get("mode", "none")).lower()
    out.put("training", "activation_checkpointing", mode in ("full", "selective"))
    if mode == "selective":
        out.dropped.append("activation_checkpoint.mode = selective (every block is checkpointed here)")
    out.dropped += [f"activation_checkpoint.{k}" for k in a if k != "mode"]


def _compile(c: dict[str, Any], out: Conversion) -> None:
    if "enable" in c:
        out.put("training", "compile", c["enable"])
    out.dropped += [f"compile.{k}" for k in c if k != "enable"]


def _validation(v: dict[str, Any], out: Conversion) -> None:
    enabled = bool(v.get("enabled", v.get("enable", False)))  # `enabled` in older releases
    out.put("training", "val_every", int(v["freq"]) if enabled else 0)
    if enabled and int(v.get("steps", -1)) > 0:  # -1: torchtitan's whole held-out set; ours: val_batches
        out.put("training", "val_batches", int(v["steps"]))
    out.dropped += _flat_keys("validation", {k: x for k, x in v.items() if k not in {"enabled", "enable", "freq",
                                                                                     "steps"}})


def _fault_tolerance(f: dict[str, Any], out: Conversion) -> None:
    for key in FAULT_TOLERANCE_SAME:
        if key in f:
            out.put("fault_tolerance", key, f[key])
    out.dropped += [f"fault_tolerance.{k}" for k in f if k not in FAULT_TOLERANCE_SAME]


def _debug(d: dict[str, Any], out: Conversion) -> None:
    if "seed" in d:  # torchtitan's seed (`training.seed` in its older releases)
        earlier = out.ours.get("training", {}).get("seed")
        if earlier is not None and earlier != d["seed"]:
            raise ConfigError(f"training.seed = {earlier} and debug.seed = {d['seed']} disagree; keep one "
                              "(debug.seed in torchtitan's current format)")
        out.put("training", "seed", d["seed"])
    out.dropped += [f"debug.{k}" for k in d if k != "seed"]


SECTIONS: dict[str, Callable[[dict[str, Any], Conversion], None]] = {
    "model": _model, "optimizer": _optimizer, "lr_scheduler": _lr_scheduler, "checkpoint": _checkpoint,
    "job": _job, "metrics": _metrics, "activation_checkpoint": _activation_checkpoint, "compile": _compile,
    "validation": _validation, "fault_tolerance": _fault_tolerance, "debug": _debug,
}


def _flat_keys(prefix: str, table: dict[str, Any]) -> list[str]:
    """Dotted names of a table's keys, nested tables included ([quantize.linear.float8])."""
    keys = []
    for key, value in table.items():
        keys += _flat_keys(f"{prefix}.{key}", value) if isinstance(value, dict) else [f"{prefix}.{key}"]
    return keys


def ranks_from_environment(env: Mapping[str, str] | None = None) -> int:
    """The island's ranks as run_train.sh knows them (NGPU x NNODES; 1 where unset or not numbers)."""
    env = os.environ if env is None else env
    try:
        return max(1, int(env.get("NGPU", "1")) * int(env.get("NNODES", "1")))
    except ValueError:
        return 1


def convert(raw: dict[str, Any], source: str = "config", ranks: int | None = None) -> Conversion:
    """Map a torchtitan-format document onto ours (ConfigError where the meaning would change).
    `ranks` sizes a data-parallel degree of -1 (default: $NGPU x $NNODES, else 1)."""
    ranks = ranks_from_environment() if ranks is None else ranks
    out = Conversion()
    given = {name: table for name, table in raw.items() if isinstance(table, dict)}
    names = [*given, *(name for name in DEFAULTS if name not in given)]
    full = {name: {**DEFAULTS.get(name, {}), **given.get(name, {})} for name in names}
    par, training = full.get("parallelism", {}), full["training"]
    try:
        _parallelism(par, training, out, ranks)
        _training(training, par, out, ranks)
        for name in full:
            if name in SECTIONS:
                SECTIONS[name](full[name], out)
            elif name not in ("parallelism", "training"):
                out.dropped += _flat_keys(name, full[name])
        out.dropped += [name for name, value in raw.items() if not isinstance(value, dict)]
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: a torchtitan-format value could not be read: {exc}") from exc
    return out

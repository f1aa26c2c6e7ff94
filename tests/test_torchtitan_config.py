"""Run files in torchtitan's format (the reference platform's) are mapped onto ours."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from archipelago.config import ConfigError, config_to_dict, load_toml
from archipelago.config.torchtitan import convert, is_torchtitan

ROOT = Path(__file__).resolve().parents[1]

# The sections and keys of torchtitan's llama3 debug run file (its JobConfig names), with values of our choosing.
TORCHTITAN = """
[job]
dump_folder = "./outputs"
description = "a debug run"

[profiling]
enable_profiling = false

[metrics]
log_freq = 5
enable_tensorboard = true

[model]
name = "llama3"
flavor = "debugmodel"
hf_assets_path = "./no/such/folder"

[optimizer]
name = "AdamW"
lr = 8e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 3
decay_ratio = 0.8
decay_type = "linear"
min_lr_factor = 0.05

[training]
local_batch_size = 4
seq_len = 64
max_norm = 0.5
steps = 12
dataset = "c4_test"
mixed_precision_param = "float32"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
pipeline_parallel_degree = 1
context_parallel_degree = 1

[checkpoint]
enable_checkpoint = true
folder = "ckpt"
interval = 6
keep_latest_k = 2
async_mode = "disabled"

[activation_checkpoint]
mode = "full"

[float8]
enable_fsdp_float8_all_gather = false

[validation]
enabled = true
freq = 4
steps = 2

[fault_tolerance]
enable = true
replica_id = 1
group_size = 2
semi_sync_method = "diloco"
sync_steps = 6
"""


@pytest.fixture()
def titan_file(tmp_path, monkeypatch):
    monkeypatch.setenv("NGPU", "2")  # data_parallel_shard_degree = -1: every rank of the island
    monkeypatch.setenv("NNODES", "1")
    path = tmp_path / "debug_model.toml"
    path.write_text(TORCHTITAN)
    return path


def test_a_torchtitan_file_loads_key_by_key_and_lists_what_it_leaves_out(titan_file, caplog):
    with caplog.at_level(logging.WARNING, logger="archipelago.config"):
        cfg = load_toml(titan_file)
    assert (cfg.model.name, cfg.model.flavor) == ("llama3", "debug")
    assert cfg.training.batch_size == 8  # 4 per rank x 2 ranks: our batch is the island's
    assert (cfg.training.steps, cfg.training.max_norm, cfg.data.seq_len) == (12, 0.5, 64)
    assert (cfg.optimizer.name, cfg.optimizer.lr, cfg.optimizer.eps) == ("adamw", 8e-4, 1e-8)
    schedule = cfg.lr_scheduler
    assert (schedule.warmup_steps, schedule.decay, schedule.min_lr_ratio) == (3, "linear", 0.05)
    ckpt = cfg.checkpoint
    assert (ckpt.enable, ckpt.folder, ckpt.interval, ckpt.keep) == (True, "ckpt", 6, 2)
    assert cfg.training.activation_checkpointing and cfg.training.mixed_precision == "fp32"
    assert (cfg.training.val_every, cfg.training.val_batches) == (4, 2)
    assert (cfg.metrics.log_every, cfg.metrics.tensorboard, cfg.job.run_dir) == (5, True, "./outputs")
    ft = cfg.fault_tolerance
    assert (ft.enable, ft.replica_id, ft.group_size, ft.semi_sync_method, ft.sync_steps) == (True, 1, 2, "diloco", 6)
    assert cfg.parallelism.data_parallel == "fsdp"
    assert len(caplog.records) == 1  # one warning, every key left out in it
    warning = caplog.records[0].getMessage()
    for left_out in ("job.description", "profiling.enable_profiling", "checkpoint.async_mode",
                     "float8.enable_fsdp_float8_all_gather", "lr_scheduler.decay_ratio", "training.dataset (c4_test",
                     "model.hf_assets_path"):
        assert left_out in warning, left_out


@pytest.mark.parametrize("section,key,value,named", [
    ("parallelism", "tensor_parallel_degree", 2, "tensor parallelism"),
    ("parallelism", "context_parallel_degree", 4, "context parallelism"),
    ("optimizer", "name", "Lion", "use AdamW or SGD"),
    ("lr_scheduler", "decay_type", "sqrt", "use linear or cosine"),
])
def test_keys_that_would_change_the_run_are_refused_naming_the_fix(section, key, value, named):
    raw = tomllib.loads(TORCHTITAN)
    raw[section][key] = value
    with pytest.raises(ConfigError, match=named) as refused:
        convert(raw, "their.toml", ranks=1)
    assert "their.toml" in str(refused.value) and key in str(refused.value)


def test_parallel_degrees_map_onto_ddp_fsdp_and_pipelines():
    raw = tomllib.loads(TORCHTITAN)
    raw["parallelism"].update(data_parallel_replicate_degree=2, data_parallel_shard_degree=1)
    ours = convert(raw, ranks=2).ours
    assert ours["parallelism"]["data_parallel"] == "ddp" and ours["training"]["batch_size"] == 8
    raw["parallelism"].update(data_parallel_replicate_degree=1, data_parallel_shard_degree=-1,
                              pipeline_parallel_degree=2, pipeline_parallel_schedule="Interleaved1F1B",
                              pipeline_parallel_microbatch_size=1)
    ours = convert(raw, ranks=4).ours
    assert ours["parallelism"]["pipeline_stages"] == 2
    assert ours["parallelism"]["pipeline_schedule"] == "interleaved_1f1b"
    assert ours["parallelism"]["pipeline_micro_batches"] == 4  # local batch 4 in micro-batches of 1
    assert ours["training"]["batch_size"] == 8  # 4 ranks / 2 stages = 2 data ranks x 4


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "NGPU": "2", "NNODES": "1"}
    return subprocess.run([sys.executable, "-m", "archipelago.launch.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT)


@pytest.mark.slow  # 10 s on 2 cores: make test-slow (the mapping is checked in-process)
def test_config_convert_prints_our_toml_that_loads_to_the_same_config(titan_file, tmp_path):
    done = _cli("config", "convert", str(titan_file))
    assert done.returncode == 0, done.stderr
    assert "# left out (no equivalent): profiling.enable_profiling" in done.stdout
    assert not is_torchtitan(tomllib.loads(done.stdout))
    ours = tmp_path / "ours.toml"
    ours.write_text(done.stdout)
    assert config_to_dict(load_toml(ours)) == config_to_dict(load_toml(titan_file))
    again = _cli("config", "convert", str(ours))
    assert again.returncode == 2 and "already in Archipelago's format" in again.stderr


def test_no_shipped_config_is_taken_for_torchtitans():
    shipped = sorted((ROOT / "configs").rglob("*.toml"))
    assert shipped
    for path in shipped:
        assert not is_torchtitan(tomllib.loads(path.read_text())), path


@pytest.mark.timeout(120)
def test_run_train_sh_takes_a_torchtitan_config_file(titan_file):
    env = {"PATH": "/usr/bin:/bin", "CONFIG_FILE": str(titan_file), "ARCHIPELAGO_DRY_RUN": "1", "ISHOST": "yes"}
    done = subprocess.run([str(ROOT / "run_train.sh"), "--fault_tolerance.replica_id=0"], capture_output=True,
                          text=True, timeout=100, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "torchtitan-format file" in done.stderr and "torch.distributed.run" in done.stdout


@pytest.mark.slow  # a real run: make test-slow
@pytest.mark.timeout(300)
def test_torchtitans_own_run_file_trains_through_run_train_sh(shakespeare, tmp_path):
    """torchtitan's llama3 debug run file, as its users start it (CONFIG_FILE=... ./run_train.sh),
    with a short run's overrides: it trains, and the run records torchtitan's settings mapped."""
    import json
    import os
    import uuid

    from conftest import kill_started_processes

    token = uuid.uuid4().hex
    env = {**{k: v for k, v in os.environ.items() if k not in ("NNODES", "MASTER_ADDR", "ISHOST", "VIRTUAL_ENV")},
           "NGPU": "1", "CONFIG_FILE": str(REAL / "llama3_debug_model.toml"), "ARCHIPELAGO_TEST_TOKEN": token}
    try:
        done = subprocess.run([str(ROOT / "run_train.sh"), "--training.steps", "3", "--data.seq_len", "64",
                               "--training.batch_size", "2", "--training.val_every", "0", "--metrics.progress",
                               "plain", "--metrics.no_tensorboard", "--checkpoint.no_enable", "--job.run_dir",
                               str(tmp_path / "run")], capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    finally:
        kill_started_processes(token)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["model"] == "llama3/debug" and summary["final_loss"] < 9.0
    ran = json.loads((tmp_path / "run" / "config.json").read_text())
    # torchtitan's optimizer and schedule, from its file and its defaults, not ours.
    assert (ran["optimizer"]["lr"], ran["optimizer"]["beta2"], ran["lr_scheduler"]["decay"]) == (8e-4, 0.95, "linear")


REAL = ROOT / "tests" / "data" / "torchtitan"  # torchtitan's own run files (BSD-3, see the folder's LICENSE)


@pytest.mark.parametrize("name,model,flavor,batch,steps", [
    ("llama3_debug_model.toml", "llama3", "debug", 8, 10),
    ("llama3_ft_debug_model.toml", "llama3", "debug", 8, 100),
    ("gpt_oss_debug_model.toml", "gpt_oss", "debug", 8, 10),
    ("qwen3_moe_debug.toml", "qwen3_moe", "debug", 4, 10),
    ("qwen3_0.6b.toml", "qwen3", "0.6B", 4, 10),
    ("llama3_8b.toml", "llama3", "8B", 1, 1000),
])
def test_torchtitans_own_run_files_load_and_validate(name, model, flavor, batch, steps, monkeypatch, caplog):
    from archipelago.config import validate

    monkeypatch.setenv("NGPU", "1")
    monkeypatch.setenv("NNODES", "1")
    raw = tomllib.loads((REAL / name).read_text())
    assert is_torchtitan(raw)
    with caplog.at_level(logging.WARNING, logger="archipelago.config"):
        cfg = load_toml(REAL / name)
    validate(cfg)  # our own checks pass on the mapped file
    assert (cfg.model.name, cfg.model.flavor) == (model, flavor)
    assert (cfg.training.batch_size, cfg.training.steps) == (batch, steps)
    assert cfg.data.seq_len == raw["training"]["seq_len"] and cfg.optimizer.lr == raw["optimizer"]["lr"]
    # torchtitan's defaults fill what the file leaves out: a linear decay to 0, no validation.
    assert (cfg.lr_scheduler.decay, cfg.training.val_every) == ("linear", 0)
    assert cfg.lr_scheduler.min_lr_ratio == raw["lr_scheduler"].get("min_lr_factor", 0.0)
    assert cfg.checkpoint.enable == raw["checkpoint"]["enable"] and cfg.checkpoint.folder == "checkpoint"
    warning = caplog.records[0].getMessage()
    assert "profiling.enable_profiling" in warning and "quantize.linear.float8.filter_fqns" in warning
    if "fault_tolerance" in raw:
        ft = cfg.fault_tolerance
        assert (ft.enable, ft.sync_steps, ft.num_fragments, ft.semi_sync_method) == (True, 10, 2, "diloco")


def test_the_docs_table_names_every_key_torchtitans_run_files_leave_unmapped():
    from archipelago.config.torchtitan import convert

    docs = (Path(__file__).resolve().parents[1] / "docs" / "federation.md").read_text()
    table = docs.split("| torchtitan key, not mapped |", 1)[1].split("\n\n", 1)[0]
    dropped = {key.split(" (")[0].split(" = ")[0] for path in REAL.glob("*.toml")
               for key in convert(tomllib.loads(path.read_text()), path.name, ranks=1).dropped}
    assert len(dropped) > 20
    missing = [key for key in sorted(dropped) if f"`{key}`" not in table and f"`{key} =" not in table]
    assert not missing, f"add these to the table in docs/federation.md: {missing}"


JOB_CONFIG = REAL / "job_config_defaults.toml"  # every field of torchtitan's JobConfig at its default
# Values for the fields whose default is None (listed in the file's header: TOML has no None).
NONE_DEFAULTS = {"job.config_file": "train.toml", "job.save_config_file": "saved.toml",
                 "model.tokenizer_path": "./tests/assets/tokenizer", "lr_scheduler.total_steps": 100,
                 "lr_scheduler.decay_ratio": 0.5, "training.dataset_path": "/data/text",
                 "training.dataloader.prefetch_factor": 2, "parallelism.module_fqns_per_model_part": [],
                 "parallelism.pipeline_parallel_layers_per_stage": 2, "checkpoint.initial_load_path": "/ckpt/step-10",
                 "quantize.linear.float8.recipe_name": "rowwise", "fault_tolerance.semi_sync_method": "diloco",
                 "validation.dataset_path": "/data/held-out", "validation.dataloader.prefetch_factor": 2,
                 "debug.seed": 3}


def _dotted(prefix: str, table: dict) -> list[str]:
    keys = []
    for key, value in table.items():
        name = f"{prefix}.{key}" if prefix else key
        keys += _dotted(name, value) if isinstance(value, dict) else [name]
    return keys


def test_every_field_of_torchtitans_job_config_is_mapped_or_named_in_the_docs_unmapped_table():
    from archipelago.config.torchtitan import convert

    text = JOB_CONFIG.read_text()
    listed = re.findall(r"^#   (\S+)$", text, flags=re.M)
    assert sorted(listed) == sorted(NONE_DEFAULTS), "give each None-default field of the header a value here"
    raw = tomllib.loads(text)
    for dotted, value in NONE_DEFAULTS.items():
        *sections, key = dotted.split(".")
        table = raw
        for section in sections:
            table = table.setdefault(section, {})
        table[key] = value
    fields = _dotted("", raw)
    assert len(fields) == 149  # torchtitan's JobConfig at that commit
    conversion = convert(raw, JOB_CONFIG.name, ranks=1)
    assert conversion.ours["training"]["seed"] == 3 and conversion.ours["data"]["path"] == "/data/text"
    assert conversion.ours["checkpoint"]["initial_load_path"] == "/ckpt/step-10"
    dropped = {key.split(" (")[0].split(" = ")[0] for key in conversion.dropped}
    assert dropped <= set(fields), sorted(dropped - set(fields))
    docs = (ROOT / "docs" / "federation.md").read_text()
    mapped_table = docs.split("| torchtitan | Archipelago |", 1)[1].split("\n\n", 1)[0]
    unmapped_table = docs.split("| torchtitan key, not mapped |", 1)[1].split("\n\n", 1)[0]
    refused = docs.split("A key whose absence would change what the run is", 1)[1].split("\n\n", 1)[0]
    # Mapped, refused above 1 (a default of 1 is accepted), or ignored beside a key that wins
    # (training.dataset beside training.dataset_path): each named somewhere in the section.
    undocumented = [key for key in fields if key not in dropped
                    and not any(f"`{key}`" in text for text in (mapped_table, unmapped_table, refused))]
    assert not undocumented, f"mapped, but not in the tables of docs/federation.md: {undocumented}"
    unlisted = [key for key in sorted(dropped)
                if f"`{key}`" not in unmapped_table and f"`{key} =" not in unmapped_table]
    assert not unlisted, f"dropped, but not in the unmapped table of docs/federation.md: {unlisted}"


def test_a_seed_in_both_of_torchtitans_places_must_agree():
    raw = {"job": {"dump_folder": "./outputs"}, "training": {"seed": 1}, "debug": {"seed": 2}}
    with pytest.raises(ConfigError, match="training.seed = 1 and debug.seed = 2 disagree"):
        convert(raw, "x.toml", ranks=1)
    assert convert({**raw, "debug": {"seed": 1}}, "x.toml", ranks=1).ours["training"]["seed"] == 1

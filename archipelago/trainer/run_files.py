"""The run folder: whether a run may resume in it (the settings its checkpoints are tied to),
whether a checkpoint holds the model, and the copy of the log lines in its train.log."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from archipelago.config import Config, config_to_dict

# Settings a checkpoint is tied to: resuming with other values would load the wrong
# shapes or data order, and training from scratch instead would overwrite the run's work.
RESUME_KEYS = (("model", "name"), ("model", "flavor"), ("data", "path"), ("data", "tokenizer"),
               ("data", "vocab_size"), ("data", "seq_len"), ("data", "val_fraction"),
               ("training", "batch_size"), ("training", "seed"))


def resume_mismatch(saved_config: Path, cfg: Config) -> str | None:
    """Why this run may not reuse the run directory that holds `saved_config`, or None."""
    if not cfg.checkpoint.resume or not saved_config.is_file():
        return None
    saved, now = json.loads(saved_config.read_text()), config_to_dict(cfg)
    diffs = [f"{a}.{b}: {saved.get(a, {}).get(b)!r} -> {now[a][b]!r}" for a, b in RESUME_KEYS
             if saved.get(a, {}).get(b) != now[a][b]]
    if not diffs:
        return None
    return (f"run directory {saved_config.parent} belongs to a run with other settings "
            f"({'; '.join(diffs)}); its checkpoints cannot be resumed with them. Use a new "
            "--job.run_dir, or the original settings to resume")


def has_model(checkpoint: Path) -> bool:
    """Whether a DCP checkpoint holds the model (not just an island's data position)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        keys = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001 - unreadable: let load_latest report it properly
        return True
    return any(k.startswith("train.") for k in keys)


class RunLog(logging.FileHandler):
    """The run directory's train.log; one at a time per process."""


def log_to_file(path: Path) -> None:
    """Copy the platform's log lines into `path`, replacing an earlier run's train.log in
    this process (trainers run one after another in tests, the simulator and benchmarks)."""
    stop_logging_to_file()
    handler = RunLog(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("archipelago").addHandler(handler)


def stop_logging_to_file() -> None:
    logger = logging.getLogger("archipelago")
    for handler in [h for h in logger.handlers if isinstance(h, RunLog)]:
        logger.removeHandler(handler)
        handler.close()

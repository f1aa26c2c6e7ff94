"""Checkpointing: DCP save/load with commit markers, verification and pruning."""

from archipelago.checkpoint.manager import CheckpointManager, CheckpointUnusable, parse_step_dir, step_dir_name
from archipelago.checkpoint.safetensors_io import export_safetensors, import_safetensors
from archipelago.checkpoint.state import LoaderState, ModelOptimizerState, ObjectState, RNGState

__all__ = [
    "CheckpointManager",
    "CheckpointUnusable",
    "LoaderState",
    "ModelOptimizerState",
    "ObjectState",
    "RNGState",
    "export_safetensors",
    "import_safetensors",
    "parse_step_dir",
    "step_dir_name",
]

"""Full-tensor safetensors export/import (used for Hugging Face export).

These work on FULL (unsharded) tensors. For an FSDP2 model, gather first,
e.g. `get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
cpu_offload=True))`, which is a collective every rank must call; then call
export_safetensors on rank 0 only.
"""

from __future__ import annotations

import logging
from pathlib import Path

from torch import Tensor

log = logging.getLogger("archipelago.checkpoint")


def export_safetensors(model_state: dict[str, Tensor], path: Path) -> None:
    """Write `model_state` to a .safetensors file (CPU, contiguous copies).

    safetensors refuses tensors that share storage (e.g. tied embedding and
    LM-head weights), so shared tensors are cloned; that costs extra host
    memory only for the shared ones.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, Tensor] = {}
    seen_storage: set[int] = set()
    for name, value in model_state.items():
        if not isinstance(value, Tensor):
            raise TypeError(f"export_safetensors: {name!r} is {type(value).__name__}, expected a tensor")
        if type(value) is not Tensor and hasattr(value, "full_tensor"):
            raise TypeError(
                f"export_safetensors: {name!r} is a sharded DTensor; gather a full state dict first "
                "(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))"
            )
        tensor = value.detach().to("cpu").contiguous()
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen_storage:
            tensor = tensor.clone()
        seen_storage.add(tensor.untyped_storage().data_ptr())
        tensors[name] = tensor
    save_file(tensors, str(path), metadata={"format": "pt"})
    log.info("exported %d tensors to %s", len(tensors), path)


def import_safetensors(path: Path) -> dict[str, Tensor]:
    """Read every tensor of a .safetensors file onto the CPU."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no safetensors file at {path}")
    return load_file(str(path), device="cpu")


__all__ = ["export_safetensors", "import_safetensors"]

"""The healing state's bytes: what a joining island receives from a peer, without pickle.

    b"ARCHST01" | header length (u64, big-endian) | header (JSON) | safetensors

The header holds the step and the tree of the state: `{"d": {...}}` a dict with string
keys, `{"l": [...]}` a list, `{"t": name}` a tensor of the body, `{"v": value}` a
number, string, boolean or null. Every tensor of the body is used exactly once. Two
parsers that cannot execute anything (JSON, safetensors) read it, and `decode_state`
checks every structural assumption; the healing transport (transport.py) moves it.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

MAGIC = b"ARCHST01"
MAX_HEADER_BYTES = 16 << 20  # the skeleton of a state is kilobytes; more is an attack
MAX_DEPTH = 32


class StateFormatError(ValueError):
    """A peer's state that is not what an island sends: refused before anything is applied."""


def encode_state(step: int, state: Any) -> bytes:
    """`state` (nested dicts with string keys, lists, tensors, numbers, strings) as bytes."""
    tensors: dict[str, torch.Tensor] = {}
    header = json.dumps({"step": step, "tree": _skeleton(state, tensors)}).encode()
    body = save_tensors({name: t.detach().to("cpu").contiguous() for name, t in tensors.items()})
    return MAGIC + struct.pack(">Q", len(header)) + header + body


def encoded_size(step: int, state: Any) -> int:
    """At least as many bytes as `encode_state(step, state)` writes, without copying a
    tensor (only their sizes are read): what a peer's state shaped like `state` takes."""
    tensors: dict[str, torch.Tensor] = {}
    header = json.dumps({"step": step, "tree": _skeleton(state, tensors)}).encode()
    # safetensors: a u64, its JSON header (an entry per tensor: its name, dtype, shape and
    # two offsets, here counted at their longest), padding to 8 bytes, then the data.
    entries = sum(len(name) + len(str(list(t.shape))) + 96 for name, t in tensors.items())
    data = sum(t.numel() * t.element_size() for t in tensors.values())
    return len(MAGIC) + 8 + len(header) + 8 + entries + 8 + data


def _skeleton(value: Any, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The header's tree of `value`; its tensors are added to `tensors` (not copied)."""
    if isinstance(value, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = value
        return {"t": name}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"state keys must be strings, got {sorted(map(repr, value))[:5]}")
        return {"d": {k: _skeleton(v, tensors) for k, v in value.items()}}
    if isinstance(value, (list, tuple)):
        return {"l": [_skeleton(v, tensors) for v in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"v": value}
    raise TypeError(f"cannot send a {type(value).__name__} in the healing state")


def decode_state(blob: bytes, step: int) -> Any:
    """The state `encode_state(step, ...)` made; StateFormatError for anything else."""
    if len(blob) < len(MAGIC) + 8 or not blob.startswith(MAGIC):
        raise StateFormatError("not an archipelago state (bad magic or truncated)")
    (size,) = struct.unpack(">Q", blob[len(MAGIC):len(MAGIC) + 8])
    start = len(MAGIC) + 8
    if size > MAX_HEADER_BYTES or start + size > len(blob):
        raise StateFormatError(f"header of {size} bytes does not fit the {len(blob)} received")
    try:
        header = json.loads(blob[start:start + size])
        tensors = load_tensors(blob[start + size:])
    except Exception as exc:  # noqa: BLE001 - whatever the parsers say, it is a bad state
        raise StateFormatError(f"unreadable state: {exc}") from exc
    if not isinstance(header, dict) or header.get("step") != step or "tree" not in header:
        raise StateFormatError(f"state for step {header.get('step') if isinstance(header, dict) else '?'}, "
                               f"expected step {step}")
    used: set[str] = set()
    state = _rebuild(header["tree"], tensors, used, 0)
    if used != tensors.keys():
        raise StateFormatError(f"{len(tensors.keys() - used)} tensor(s) of the body are not in the state")
    return state


def _rebuild(node: Any, tensors: dict[str, torch.Tensor], used: set[str], depth: int) -> Any:
    if depth > MAX_DEPTH or not isinstance(node, dict) or len(node) != 1:
        raise StateFormatError("malformed state tree")
    kind, value = next(iter(node.items()))
    if kind == "d" and isinstance(value, dict):
        return {k: _rebuild(v, tensors, used, depth + 1) for k, v in value.items()}
    if kind == "l" and isinstance(value, list):
        return [_rebuild(v, tensors, used, depth + 1) for v in value]
    if kind == "t" and isinstance(value, str) and value in tensors and value not in used:
        used.add(value)
        return tensors[value]
    if kind == "v" and (value is None or isinstance(value, (bool, int, float, str))):
        return value
    raise StateFormatError(f"malformed state tree node {kind!r}")

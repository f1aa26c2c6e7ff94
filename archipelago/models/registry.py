"""Flavor registry: (family, flavor) -> ModelArgs, and model construction."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

import torch

from .args import ModelArgs
from .transformer import Transformer

M = TypeVar("M", bound=torch.nn.Module)

# Vocab used only to *display* flavors whose vocab comes from the tokenizer.
DEFAULT_VOCAB_SIZE = 4096

FAMILIES: dict[str, dict[str, ModelArgs]] = {}


def register_family(name: str, flavors: dict[str, ModelArgs]) -> None:
    """Register a model family; re-registering the same dict is a no-op."""
    existing = FAMILIES.get(name)
    if existing is not None and existing is not flavors:
        raise ValueError(f"model family {name!r} is already registered; pick another name")
    FAMILIES[name] = flavors


def _lookup(kind: str, name: str, valid: dict[str, ModelArgs] | dict[str, dict[str, ModelArgs]]):
    if name in valid:
        return valid[name]
    names = list(valid)
    # Case-insensitive suggestion so "8b" points at "8B".
    lowered = {n.lower(): n for n in names}
    close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.5)
    hint = f"; did you mean {lowered[close[0]]!r}?" if close else ""
    raise ValueError(f"unknown {kind} {name!r}{hint} Valid {kind}s: {', '.join(names)}")


def get_model_args(name: str, flavor: str, vocab_size: int | None = None) -> ModelArgs:
    """Return a copy of the flavor's args with vocab_size resolved."""
    flavors = _lookup("model family", name, FAMILIES)
    args: ModelArgs = _lookup(f"{name} flavor", flavor, flavors)
    if args.vocab_size is None:
        if vocab_size is None:
            raise ValueError(
                f"{name}/{flavor} takes its vocab size from the tokenizer; "
                "pass vocab_size=<tokenizer vocab size>"
            )
        return replace(args, vocab_size=vocab_size)
    if vocab_size is not None and vocab_size > args.vocab_size:
        raise ValueError(
            f"tokenizer vocab_size {vocab_size} is larger than {name}/{flavor}'s fixed "
            f"vocab_size {args.vocab_size}; use a matching tokenizer or another flavor"
        )
    # A smaller tokenizer vocab is fine: the extra embedding rows are unused.
    return replace(args)


def build_on(device: str | torch.device, make: Callable[[], M]) -> M:
    """`make()` constructed under `device`; off meta, its parameters are also initialised
    (every model family has `init_weights`)."""
    device = torch.device(device)
    with device:
        model = make()
    if device.type != "meta":
        model.init_weights()  # type: ignore[operator]
    return model


def build_model(args: ModelArgs, device: str | torch.device = "meta") -> Transformer:
    """Construct under `device`; off meta, parameters are also initialised."""
    return build_on(device, lambda: Transformer(args))


def list_flavors(
    vocab_size: int | None = DEFAULT_VOCAB_SIZE,
) -> list[tuple[str, str, ModelArgs]]:
    """All (family, flavor, args copy). Tokenizer-vocab flavors get `vocab_size`
    filled in (so num_params() works); pass None to keep them unresolved."""
    out = []
    for family, flavors in FAMILIES.items():
        for flavor, args in flavors.items():
            if args.vocab_size is None and vocab_size is not None:
                out.append((family, flavor, replace(args, vocab_size=vocab_size)))
            else:
                out.append((family, flavor, replace(args)))
    return out

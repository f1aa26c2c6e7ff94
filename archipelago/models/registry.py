"""Flavor registry: (family, flavor) -> ModelArgs, and model construction.

Language-model families (transformers, `ModelArgs`) live in FAMILIES; image families
(ResNet, their own args class) in IMAGE_FAMILIES. `family_kind` says which a name is.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal, TypeVar

import torch

from .args import ModelArgs
from .transformer import Transformer

M = TypeVar("M", bound=torch.nn.Module)

# Vocab used only to *display* flavors whose vocab comes from the tokenizer.
DEFAULT_VOCAB_SIZE = 4096

FAMILIES: dict[str, dict[str, ModelArgs]] = {}
# Families whose args are not ModelArgs say how to build their model (args type -> builder).
BUILDERS: dict[type, Callable[[Any], torch.nn.Module]] = {}
IMAGE_FAMILIES: dict[str, dict[str, Any]] = {}


def register_family(name: str, flavors: dict[str, ModelArgs],
                    builder: Callable[[Any], torch.nn.Module] | None = None) -> None:
    """Register a language-model family; re-registering the same dict is a no-op. A family
    whose flavors are not ModelArgs (GPT-OSS) gives the `builder` of its model."""
    existing = FAMILIES.get(name)
    if existing is not None and existing is not flavors:
        raise ValueError(f"model family {name!r} is already registered; pick another name")
    FAMILIES[name] = flavors
    if builder is not None:
        for args in flavors.values():
            BUILDERS[type(args)] = builder


def register_image_family(name: str, flavors: dict[str, Any]) -> None:
    """Register an image-classification family (its flavors' args are the family's own class)."""
    existing = IMAGE_FAMILIES.get(name)
    if name in FAMILIES or (existing is not None and existing is not flavors):
        raise ValueError(f"model family {name!r} is already registered; pick another name")
    IMAGE_FAMILIES[name] = flavors


def family_kind(name: str) -> Literal["language", "image"]:
    """Whether `name` is a language-model or an image family (ValueError naming the
    valid families, with a suggestion, when it is neither)."""
    _lookup("model family", name, {**FAMILIES, **IMAGE_FAMILIES})
    return "image" if name in IMAGE_FAMILIES else "language"


def get_image_model_args(name: str, flavor: str) -> Any:
    """The args of an image family's flavor (ValueError with a suggestion when unknown)."""
    flavors = _lookup("image model family", name, IMAGE_FAMILIES)
    return _lookup(f"{name} flavor", flavor, flavors)


def _lookup(kind: str, name: str, valid: dict[str, Any]) -> Any:
    if name in valid:
        return valid[name]
    names = list(valid)
    # Case-insensitive suggestion so "8b" points at "8B".
    lowered = {n.lower(): n for n in names}
    close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.5)
    hint = f"; did you mean {lowered[close[0]]!r}?" if close else ""
    raise ValueError(f"unknown {kind} {name!r}{hint} Valid: {', '.join(names)}")


def get_model_args(name: str, flavor: str, vocab_size: int | None = None) -> ModelArgs:
    """Return a copy of the flavor's args with vocab_size resolved."""
    if name in IMAGE_FAMILIES:
        raise ValueError(f"{name} is an image-classification family, not a language model; "
                         "train it with --data.dataset fashion_mnist")
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
    builder = BUILDERS.get(type(args), Transformer)
    return build_on(device, lambda: builder(args))  # type: ignore[return-value]


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

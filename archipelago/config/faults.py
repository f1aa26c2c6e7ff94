"""Injected faults for tests, drills and demos: one grammar for every way to ask for one.

    [ISLAND:]KIND@AT

| KIND | AT | what happens | who acts |
|---|---|---|---|
| `kill` | seconds after the start | every process of the island is SIGKILLed | `archipelago local --kill` |
| `kill_at_step` | inner step | the same, once its metrics show that step or a later one | `local --kill ISLAND@stepN` |
| `crash` | inner step | the trainer SIGKILLs itself after that step | the trainer |
| `error` | inner step | the trainer raises an exception after that step | the trainer |
| `nan-loss` | inner step | that step's loss becomes NaN | the trainer |
| `nan` | outer step | the island's pseudo-gradient becomes NaN | the outer loop |
| `scale1000` | outer step | the island's pseudo-gradient is multiplied by 1000 | the outer loop |
| `forge_tokens` | outer step | the island claims 10^15 tokens for its pseudo-gradient | the outer loop |
| `forge_weight` | outer step | the island claims weight -10^6 for its pseudo-gradient | the outer loop |
| `unsigned` | outer step | the island signs its pseudo-gradient with a key outside the federation | the outer loop |
| `equivocate` | outer step | the island sends each peer another validly signed row (all-gather) | the outer loop |
| `censor` | outer step | as a summer, the island calls every other segment it got unsigned | the outer loop |
| `split_receipt` | outer step | its receipt tells one peer a row was missing, the others the truth | the outer loop |
| `die_in_exchange` | outer step | the island SIGKILLs itself, its row of that exchange in flight | the outer loop |

`archipelago local --inject ISLAND:KIND@AT` (repeatable, every entry kept) hands an
island its faults in the environment variable `ARCHIPELAGO_FAULT` (`KIND@AT[,KIND@AT...]`,
no island: it is that island's); `ARCHIPELAGO_FAULT_RANK=R` limits the trainer's faults
to rank R. These are for tests and demos: never set them in real runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from archipelago.config.errors import ConfigError

ENV = "ARCHIPELAGO_FAULT"
RANK_ENV = "ARCHIPELAGO_FAULT_RANK"

LAUNCHER_KINDS = ("kill", "kill_at_step")
TRAINER_KINDS = ("crash", "error", "nan-loss")
POISON_KINDS = ("nan", "scale1000", "forge_tokens", "forge_weight", "unsigned", "equivocate", "censor",
                "split_receipt")
EXCHANGE_KINDS = ("die_in_exchange",)  # the island dies mid-exchange (the survivors' retry: docs/rounds.md)
OUTER_KINDS = POISON_KINDS + EXCHANGE_KINDS  # acted on by the outer loop, AT in outer steps
KINDS = LAUNCHER_KINDS + TRAINER_KINDS + OUTER_KINDS
_UNIT = {"kill": "SECONDS", "kill_at_step": "STEP", **{k: "STEP" for k in TRAINER_KINDS},
         **{k: "ROUND" for k in OUTER_KINDS}}
_EXAMPLE = "1:kill@30, crash@7, nan-loss@3 or 1:scale1000@4"


@dataclass(frozen=True)
class Fault:
    kind: str
    at: float  # seconds (kill), inner step (kill_at_step, trainer kinds) or outer step (outer-loop kinds)
    island: int | None = None

    def __str__(self) -> str:
        at = f"{self.at:g}"
        return f"{self.kind}@{at}" if self.island is None else f"{self.island}:{self.kind}@{at}"


def parse_fault(text: str, where: str = ENV, kinds: tuple[str, ...] = KINDS,
                island: bool | None = None) -> Fault:
    """`[ISLAND:]KIND@AT` -> Fault. `kinds` limits the kinds `where` accepts; `island`
    True requires an island, False forbids one. ConfigError naming the form otherwise."""
    head, _, at_text = text.strip().partition("@")
    island_text, _, kind = head.rpartition(":")
    expected = (f"{where}={text!r}: expected [ISLAND:]KIND@AT with KIND one of {', '.join(kinds)} "
                f"(AT in {', '.join(sorted({_UNIT[k] for k in kinds}))}), e.g. {_EXAMPLE}")
    if kind not in kinds or (island is True and not island_text) or (island is False and island_text):
        raise ConfigError(expected)
    if island_text and not island_text.isdigit():
        raise ConfigError(expected)
    try:
        at = float(at_text)
    except ValueError:
        raise ConfigError(expected) from None
    whole = kind != "kill"
    if at < 0 or (whole and (at != int(at) or (kind in OUTER_KINDS and at < 1))):
        raise ConfigError(expected + ("; outer steps count from 1" if kind in OUTER_KINDS else ""))
    return Fault(kind, int(at) if whole else at, int(island_text) if island_text else None)


def parse_faults(text: str, where: str = ENV, kinds: tuple[str, ...] = KINDS) -> list[Fault]:
    """A comma-separated list of faults of one island (the environment variable's form)."""
    return [parse_fault(part, where, kinds, island=False) for part in text.split(",") if part.strip()]


def faults_from_env(kinds: tuple[str, ...], rank: int | None = None) -> list[Fault]:
    """This process's faults of the given kinds from ARCHIPELAGO_FAULT (none when unset;
    none when ARCHIPELAGO_FAULT_RANK names another rank). A malformed entry of any kind
    is an error, so a typo fails at start, not mid-run."""
    spec = os.environ.get(ENV, "")
    faults = parse_faults(spec)
    only_rank = os.environ.get(RANK_ENV)
    if only_rank is not None and rank is not None and int(only_rank) != rank:
        return []
    return [f for f in faults if f.kind in kinds]


def env_value(faults: list[Fault]) -> str:
    """The ARCHIPELAGO_FAULT value for one island's faults."""
    return ",".join(str(Fault(f.kind, f.at)) for f in faults)

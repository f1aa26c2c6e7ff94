"""Everything between islands: membership (torchft), the bridge, the outer loop."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from archipelago.config import ConfigError
from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.carrying import declared_tokens_per_step
from archipelago.federation.decoupled import check_decoupled
from archipelago.federation.diloco import OuterLoop
from archipelago.federation.fragments import NamedParameters, named_parameters, split_fragments
from archipelago.federation.guard import poisons_from_env
from archipelago.federation.membership import (
    FederationMismatch,
    LighthouseUnreachable,
    build_manager,
    check_membership,
    fingerprint,
    lighthouse_address,
    wait_for_lighthouse,
)
from archipelago.federation.outcome import FederationError
from archipelago.federation.round_book import OuterReport, report_record
from archipelago.federation.seam import Alone, Federation, IslandHooks, Member, data_shard, scales_inner_batch
from archipelago.federation.trust import FederationKey, refuse_exposed_without_key

log = logging.getLogger("archipelago.federation")

__all__ = ["Alone", "Federation", "FederationError", "FederationMismatch", "IslandHooks", "LighthouseUnreachable",
           "Member", "OuterLoop", "OuterReport", "build_federation", "build_outer_loop", "check_exchange_device",
           "data_shard", "island_fingerprint", "report_record", "scales_inner_batch", "split_fragments"]


def build_federation(ft: FaultToleranceConfig, steps: int, model: nn.Module | NamedParameters, model_name: str,
                     rank: int,
                     world_size: int, tokens_per_step: int, hooks: IslandHooks,
                     optimizer: torch.optim.Optimizer | None = None, key: FederationKey | None = None,
                     insecure: bool = False, compute: str = "") -> Federation:
    """The trainer's side of the seam: `Alone` without fault tolerance, a `ThinIsland` with
    a `carrier`, else a `Member` that has joined the lighthouse (a collective over the
    island; see build_outer_loop).
    A member that serves healing beyond loopback needs `key`, or `insecure`. `compute`:
    what the island computes with (device, dtype, backend), declared at the join."""
    if not ft.enable:
        return Alone(steps)
    if ft.carrier:  # a thin island: no quorum, its carrier only (thin.py)
        from archipelago.federation.thin import ThinIsland

        return ThinIsland(ft, steps, split_fragments(named_parameters(model), 1)[0], rank, world_size, key, hooks)
    refuse_exposed_without_key(key, insecure)
    outer = build_outer_loop(ft, model, model_name, rank, world_size, tokens_per_step, optimizer, key, compute)
    return Member(outer, ft, steps, tokens_per_step, world_size, hooks)


def check_exchange_device(ft: FaultToleranceConfig, device: torch.device) -> None:
    """NCCL only carries GPU tensors: refuse settings that would hand it CPU ones."""
    if ft.process_group != "nccl":
        return
    if device.type == "cpu":
        raise ConfigError("fault_tolerance.process_group = \"nccl\" on a CPU island: NCCL needs GPUs; "
                          "use process_group = \"tcp\"")
    if ft.copy_pseudogradients_to_cpu:
        raise ConfigError("fault_tolerance.copy_pseudogradients_to_cpu = true sends CPU tensors, which NCCL "
                          "cannot carry; use process_group = \"tcp\" or copy_pseudogradients_to_cpu = false")


def build_outer_loop(ft: FaultToleranceConfig, model: nn.Module | NamedParameters, model_name: str, rank: int,
                     world_size: int, tokens_per_step: int = 0,
                     optimizer: torch.optim.Optimizer | None = None, key: FederationKey | None = None,
                     compute: str = "") -> OuterLoop:
    """Join the federation: check the lighthouse, make the bridge ranks' managers, and
    take the current weights as the first global weights (a collective over the island)."""
    check_decoupled(ft)
    named = named_parameters(model)  # a pipeline stage: the whole model's, others' parameters on meta
    check_exchange_device(ft, next((p.device for _, p in named if not p.is_meta), torch.device("cpu")))
    url = lighthouse_address(ft)
    problem: tuple[bool, str] | None = None  # (refused by the gate, message)
    if rank == 0:
        try:
            wait_for_lighthouse(url, ft.connect_timeout_ms / 1000)
            check_membership(url, key, ft)
        except (LighthouseUnreachable, FederationMismatch) as exc:
            problem = (isinstance(exc, FederationMismatch), str(exc))
    if world_size > 1:  # every rank fails together instead of waiting in a collective
        box = [problem]
        dist.broadcast_object_list(box, src=0)  # inside the island: its own ranks' bytes
        problem = box[0]
    if problem is not None:
        raise (FederationMismatch if problem[0] else LighthouseUnreachable)(problem[1])
    fp = island_fingerprint(ft, named, model_name, world_size, tokens_per_step, optimizer, key, compute)
    poisons = poisons_from_env()  # checked before joining: a typo fails here, not mid-run
    width = 1 if ft.rank0_synchronization_only else ft.sync_width
    manager = build_manager(ft, rank, width, key) if rank < width else None
    fragments = split_fragments(named, ft.num_fragments if ft.semi_sync_method == "diloco" else 1)
    if rank == 0:
        log.info("joining the federation at %s as island %d (%d rank(s), sync_width %d, %s, "
                 "sync every %d steps, %d fragment(s), %s)", url, ft.replica_id, world_size, width,
                 ft.semi_sync_method, ft.sync_steps, len(fragments), fp["federation"])
    for poison in poisons if rank == 0 else []:
        what = ("will die with its exchange of outer step %d in flight (a drill of exchange_retries)"
                if poison.kind == "die_in_exchange" else
                "will send a poisoned pseudo-gradient in outer step %d (a test/demo of the guard)")
        log.warning("ARCHIPELAGO_FAULT %s@%d: this island " + what, poison.kind, poison.round, poison.round)
    return OuterLoop(ft, fragments, rank, world_size, manager, fp, poisons=poisons, optimizer=optimizer, key=key,
                     tokens_per_step=tokens_per_step)


def island_fingerprint(ft: FaultToleranceConfig, named: NamedParameters, model_name: str, world_size: int,
                       tokens_per_step: int, optimizer: torch.optim.Optimizer | None,
                       key: FederationKey | None, compute: str = "") -> dict[str, Any]:
    """What this island declares at the join (membership.fingerprint): its trainable
    parameters' names and shapes, its inner optimizer, settings and federation key, and
    what it computes with (`compute`, declared, not compared). A member that carries a thin
    island declares the carried tokens too (carrying.declared_tokens_per_step).
    `archipelago doctor` computes the same from a run file, to compare with a peer's."""
    shapes = [(name, tuple(p.shape)) for name, p in named if p.requires_grad]
    declared = declared_tokens_per_step(ft, tokens_per_step)
    return fingerprint(model_name, shapes, ft, world_size, declared, _optimizer_name(optimizer), key,
                       _peak_lr(optimizer), compute, batch_tokens=tokens_per_step)


def _optimizer_name(optimizer: torch.optim.Optimizer | None) -> str:
    """The inner optimizer as islands that average its moments must agree on it: its
    class and betas (the receivers' bound on a peer's moments depends on them)."""
    if optimizer is None:
        return ""
    betas = optimizer.param_groups[0].get("betas")
    name = type(optimizer).__name__
    return f"{name}, betas {betas[0]:g}/{betas[1]:g}" if betas is not None else name


def _peak_lr(optimizer: torch.optim.Optimizer | None) -> float:
    """The inner optimizer's largest learning rate (a scheduler keeps it as `initial_lr`)."""
    if optimizer is None:
        return 0.0
    return max(float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups)

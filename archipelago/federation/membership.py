"""Membership of an island in a federation: the torchft Manager of each bridge rank.

Only bridge ranks (island ranks 0 .. sync_width-1) talk across islands, so only they
create a torchft `Manager`, with rank s and world size sync_width: torchft pairs group
rank s of every island, which is exactly "bridge rank s of every island all-reduces
chunk s". The other ranks learn the quorum's outcome from island rank 0.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from datetime import timedelta
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlparse

import torch
from torch.distributed import TCPStore

from archipelago.config import ConfigError
from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.codecs import effective_codec
from archipelago.federation.give_up import remember_store
from archipelago.federation.policy import StateClaim, claimed_step
from archipelago.federation.trust import (
    FederationKey,
    FrameHeader,
    FrameRefused,
    check_member_id,
    member_id,
    open_frame,
    seal,
)
from archipelago.netutil import bound_tcp_store, local_address

log = logging.getLogger("archipelago.federation")


class FederationMismatch(ConfigError):
    """This island's model or bridge does not match the federation it tried to join."""


class LighthouseUnreachable(ConfigError):
    """The lighthouse did not answer within the connect timeout."""


def lighthouse_address(ft: FaultToleranceConfig) -> str:
    """The lighthouse URL from the config or $TORCHFT_LIGHTHOUSE, or a ConfigError naming both."""
    url = ft.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not url:
        raise ConfigError("fault_tolerance.enable needs a lighthouse: start one with `archipelago "
                          "lighthouse --bind HOST:29510` (HOST: an address the islands reach) and pass "
                          "--fault_tolerance.lighthouse http://HOST:29510 (or export TORCHFT_LIGHTHOUSE)")
    return url if "://" in url else f"http://{url}"


def wait_for_lighthouse(url: str, timeout_s: float) -> None:
    """Return once a TCP connection to the lighthouse succeeds; raise after `timeout_s`.

    torchft would otherwise retry inside its Rust client and surface the failure only at
    the first quorum, as a long timeout with a gRPC trace; this says what to fix.
    """
    parsed = urlparse(url)
    host, port = parsed.hostname, parsed.port
    if not host or not port:
        raise ConfigError(f"lighthouse address {url!r} is not http://HOST:PORT; fix "
                          "--fault_tolerance.lighthouse or TORCHFT_LIGHTHOUSE")
    deadline, error = time.monotonic() + timeout_s, None
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, timeout_s))):
                return
        except OSError as exc:
            error = exc
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    raise LighthouseUnreachable(
        f"cannot reach the lighthouse at {url} ({error}) within {timeout_s:.0f} s "
        "(fault_tolerance.connect_timeout_ms); start it with `archipelago lighthouse` or fix "
        "--fault_tolerance.lighthouse / TORCHFT_LIGHTHOUSE")


def check_membership(url: str, key: FederationKey | None, ft: FaultToleranceConfig) -> None:
    """Raise FederationMismatch, naming the fix, if the lighthouse's gate would refuse this
    island (no key, or another federation's); torchft would only wait for a quorum that
    never comes."""
    from archipelago.federation.gate import check_admission

    if check_admission(url, member_id(key, ft.replica_id), ft.connect_timeout_ms / 1000, key):
        return
    if key is None:
        raise FederationMismatch(
            f"the lighthouse at {url} admits only the islands that hold its federation's key, and this island "
            "has none: give it the federation's key file (ARCHIPELAGO_FEDERATION_KEY_FILE or "
            "[federation_security] key_file)")
    raise FederationMismatch(
        f"the lighthouse at {url} refused this island's member token: its federation key is not this "
        f"island's (key {key.federation_id.hex()[:12]}); give the lighthouse and every island the same key file")


def _store_for_manager() -> tuple[str, int, TCPStore | None]:
    """Where the bridge ranks' TCPStore is: torchrun's, or one we host for a lone process.

    The address is advertised to the other islands (their cross-island process groups
    rendezvous in the quorum leader's store), so LOCAL_ADDR wins over MASTER_ADDR. A store
    we host listens on that address only (LOCAL_ADDR, else loopback).
    """
    advertised = os.environ.get("LOCAL_ADDR") or ""
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return advertised or os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None
    host = local_address()
    store = bound_tcp_store(host)
    return host, store.port, store


@contextlib.contextmanager
def _manager_server_bound_to(host: str) -> Iterator[None]:
    """torchft's Manager starts its ManagerServer on every interface (`[::]`), with no
    option, and that server answers anyone (its Kill exits the process). While it is
    built, hand torchft a gated one (federation/manager_gate.py): the server on the
    island's internal address (loopback, or MASTER_ADDR when the bridge ranks span hosts),
    advertised as `host`, and on `host` (LOCAL_ADDR), at the same port (0 or
    $TORCHFT_MANAGER_PORT), a gate that answers only the healing call."""
    import torchft.manager as torchft_manager

    from archipelago.federation.manager_gate import gated_manager_server

    original = torchft_manager.ManagerServer
    torchft_manager.ManagerServer = gated_manager_server(original, host)
    try:
        yield
    finally:
        torchft_manager.ManagerServer = original


def _drop_flight_recorder_warning(record: logging.LogRecord) -> bool:
    return "NCCL flight recorder" not in record.getMessage()


def build_manager(ft: FaultToleranceConfig, bridge_rank: int, width: int, key: FederationKey | None = None) -> Any:
    """A torchft Manager for bridge rank `bridge_rank` of this island (state fns added later)."""
    # torchft logs every quorum and commit at INFO (Rust and Python); our outer_step
    # lines say the same once per round. RUST_LOG / --job.log_level debug bring them back.
    os.environ.setdefault("RUST_LOG", "warn")
    if not log.isEnabledFor(logging.DEBUG):
        for name in ("torchft", "torchft_quorums", "torchft_commits"):
            logging.getLogger(name).setLevel(logging.WARNING)
    if ft.process_group != "nccl":  # no NCCL flight recorder: torchft warns every quorum
        logging.getLogger("torchft.manager").addFilter(_drop_flight_recorder_warning)
    from torchft import Manager

    url = lighthouse_address(ft)
    timeout = timedelta(milliseconds=ft.process_group_timeout_ms)
    pg = cross_island_group(ft.process_group, timeout, key)
    host, port, store = _store_for_manager()
    # The manager server is where this island's bridge ranks ask for quorums: inside the
    # island; other islands reach only its healing call, through a gate on LOCAL_ADDR.
    local = local_address()
    with _manager_server_bound_to(local):
        manager = Manager(
            pg=pg, load_state_dict=None, state_dict=None, min_replica_size=ft.min_replica_size,
            use_async_quorum=False,  # the outer loop needs the quorum before it averages
            timeout=timeout, quorum_timeout=timedelta(milliseconds=ft.quorum_timeout_ms),
            connect_timeout=timedelta(milliseconds=ft.connect_timeout_ms),
            rank=bridge_rank, world_size=width, store_addr=host, store_port=port,
            lighthouse_addr=url, replica_id=member_id(key, ft.replica_id), hostname=local,
            max_retries=ft.max_retries, checkpoint_transport=_checkpoint_transport(timeout, key, ft.replica_id),
            init_sync=ft.init_sync,
        )
    manager._archipelago_store = store  # keep a self-hosted store alive as long as the manager
    manager._archipelago_outsiders = []
    readmit = None
    if key is not None and bridge_rank == 0:  # the rank whose host torchft's manager server runs on
        from archipelago.federation.gate import check_admission

        def readmit() -> bool:
            return check_admission(url, member_id(key, ft.replica_id), ft.connect_timeout_ms / 1000, key)
    manager._client = MembersOnly(manager._client, key, manager, readmit)
    return manager


_QUORUM_FIELDS = ("quorum_id", "replica_rank", "replica_world_size", "recover_src_manager_address",
                  "recover_src_replica_rank", "recover_dst_replica_ranks", "store_address", "max_step",
                  "max_replica_rank", "max_world_size", "heal", "commit_failures", "replica_ids")


def cross_island_group(backend: str, timeout: timedelta, key: FederationKey | None = None) -> Any:
    """The process group between the islands' bridge ranks: ours over checked TCP (`tcp`:
    no peer can abort this process, federation/tcp_group.py), torchft's gloo or NCCL."""
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    if backend == "nccl":
        return ProcessGroupNCCL(timeout=timeout)
    if backend == "gloo":
        return ProcessGroupGloo(timeout=timeout)
    from archipelago.federation.tcp_group import CheckedTCPGroup

    return CheckedTCPGroup(timeout, key)


class MembersOnly:
    """torchft's ManagerClient of an island with a federation key: every quorum the
    lighthouse hands out is checked for members without a valid member token.

    The lighthouse gate (federation/gate.py) keeps outsiders out of quorums; this is the
    island's own check, for a lighthouse without the gate. A quorum with an outsider
    heals nobody and serves nobody (an outsider that claims the highest step would be
    torchft's healing source), and the island names the outsiders in
    `manager._archipelago_outsiders` so that the round reports an error and commits
    nothing (OuterLoop._membership).

    A quorum request that fails is tried once more after `readmit` (bridge rank 0 with a
    key: prove the member token to the lighthouse's gate again). A restarted gate has
    forgotten every proof and refuses the island's calls until then; torchft only reports
    the quorum timeout, so a real failure costs a second timeout before it surfaces.
    """

    def __init__(self, client: Any, key: FederationKey | None, manager: Any,
                 readmit: Callable[[], bool] | None = None) -> None:
        self._client, self._key, self._manager, self._readmit = client, key, manager, readmit

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        try:
            quorum = self._client._quorum(*args, **kwargs)
        except Exception:
            if self._readmit is None or not self._readmit():
                raise
            log.warning("a quorum request failed; proved this island's member token to the lighthouse again "
                        "(a restarted lighthouse forgets it) and asks once more")
            quorum = self._client._quorum(*args, **kwargs)
        # The healing download may only go to the host of the member the quorum names as its
        # source (torchft asks that member's manager for the URL, which the member chooses).
        expect_source = getattr(getattr(self._manager, "_checkpoint_transport", None), "expect_source", None)
        if quorum.heal and expect_source is not None:
            expect_source(quorum.recover_src_manager_address)
        # The members by replica rank: a retry's segment repair maps the old quorum onto the new.
        self._manager._archipelago_replica_ids = list(getattr(quorum, "replica_ids", []) or [])
        remember_store(self._manager, quorum)  # where a member that gives an exchange up says so
        if self._key is None:
            return quorum
        outsiders = [rid for rid in quorum.replica_ids if check_member_id(self._key, rid) is None]
        self._manager._archipelago_outsiders = outsiders
        if not outsiders:
            return quorum
        # torchft's QuorumResult lacks some of the fields on some versions (commit_failures)
        view = {name: getattr(quorum, name) for name in _QUORUM_FIELDS if hasattr(quorum, name)}
        view.update(heal=False, recover_dst_replica_ranks=[])
        return SimpleNamespace(**view)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def _checkpoint_transport(timeout: timedelta, key: FederationKey | None = None, island: int = 0) -> Any:
    """The healing transport: pickle-free, bound to LOCAL_ADDR or loopback, advertising it,
    and with a federation key signed both ways.

    torchft's own transport unpickles what a peer sends and listens on every interface;
    ours sends JSON and safetensors and listens where the user said (federation/transport.py).
    """
    from archipelago.federation.transport import SafeHTTPTransport

    return SafeHTTPTransport(timeout, key=key, island=island)


# ---- fingerprints ------------------------------------------------------------------

# What every island must agree on; anything else (rank count, device) may differ.
FINGERPRINT_KEYS = ("model", "params", "shapes", "sync_width", "num_fragments", "semi_sync_method",
                    "outer", "pacing", "codec", "start", "inner_state", "federation")


def fingerprint(model_name: str, named_shapes: list[tuple[str, tuple[int, ...]]],
                ft: FaultToleranceConfig, ranks: int, tokens_per_step: int = 0,
                inner_optimizer: str = "", key: FederationKey | None = None,
                inner_lr: float = 0.0, compute: str = "", batch_tokens: int | None = None) -> dict[str, Any]:
    """A description of this island that peers compare at join time.

    `compute` (device, dtype and backend: `cpu float32, dace 1.0.2, generated loops`) is declared, not
    compared: islands of unlike hardware train one model; every island logs its members'.
    `tokens_per_step` and `inner_lr` are declared, not compared too: islands may differ in
    both, and every receiver bounds what an island may claim in a round by them
    (policy.judge_contributions), each held to `declared_limit` x the other islands'
    median (policy.bounded_batches), a limit all islands must agree on.

    Under time pacing the round budget and the federation's token budget (training.steps
    x this island's own tokens per step, `batch_tokens`, default `tokens_per_step`, x
    group_size) must agree: all islands end together when the federation has trained that
    many tokens. (A carrier declares more tokens per step than its batch: its thin
    island's; the budget counts its batch.)
    """
    shapes = hashlib.sha256(json.dumps(named_shapes).encode()).hexdigest()[:16]
    batch = tokens_per_step if batch_tokens is None else batch_tokens
    outer = (f"{ft.outer_optimizer}(lr={ft.outer_lr}, momentum={ft.outer_momentum}, "
             f"nesterov={ft.outer_nesterov}) alpha={ft.fragment_update_alpha}")
    if ft.outer_aggregation != "mean":
        outer += f" {ft.outer_aggregation}"
    outer += f", declarations <= {ft.declared_limit:g}x the median"
    if ft.max_island_share < 1:
        outer += f", one island <= {ft.max_island_share:g} of a round"
    return {"island": ft.replica_id, "ranks": ranks, "model": model_name,
            "params": sum(math.prod(s) for _, s in named_shapes), "shapes": shapes,
            "sync_width": ft.sync_width, "num_fragments": ft.num_fragments,
            "semi_sync_method": ft.semi_sync_method, "outer": outer, "pacing": _pacing(ft, batch),
            "codec": _codec(ft), "start": "from a peer" if ft.init_sync else "own weights",
            "inner_state": (f"averaged ({inner_optimizer}, {ft.moments_dtype})" if ft.average_optimizer_state
                            else "own")
            + (", AdamW of the federation's batch" if ft.adam_federation_batch else ""),
            # Which secret, as its public id (a diagnosis: a peer with another key is named at
            # the join; the frames are what keeps it out).
            "federation": f"key {key.federation_id.hex()[:12]}" if key is not None else "no key",
            "tokens_per_step": tokens_per_step, "inner_lr": inner_lr, "compute": compute}


def _codec(ft: FaultToleranceConfig) -> str:
    name = effective_codec(ft)
    if name == "int8":
        return f"int8(block {ft.codec_block_size})"
    if name == "topk":
        decay = f", error decay {ft.topk_error_decay:g}" if ft.topk_error_decay != 1 else ""
        early = (f", {ft.topk_early_fraction:g} in the first {ft.topk_early_rounds} rounds"
                 if ft.topk_early_rounds else "")
        return (f"topk({ft.topk_fraction:g}, {ft.topk_bits} bits, chunk {ft.topk_chunk_size}, "
                f"{ft.topk_exchange}{decay}{early})")
    if name == "auto":
        topk = _codec(replace(ft, codec="topk"))
        int8 = _codec(replace(ft, codec="int8"))
        return f"auto(target {ft.target_exchange_s:g} s; {int8}, {topk})"
    return name


def _pacing(ft: FaultToleranceConfig, tokens_per_step: int) -> str:
    # Decoupled rounds: every island must decide overlap and staleness alike (decoupled.py).
    mode = ("" if ft.round_mode == "synchronous" else
            f", decoupled(overlap above {ft.overlap_threshold:g}, staleness^-{ft.staleness_exponent:g} "
            f"up to {ft.max_staleness}{f', applied {ft.arrival_steps} steps in' if ft.arrival_steps else ''})")
    if ft.round_pacing == "steps":
        return f"steps({ft.sync_steps}) {ft.outer_weighting}{mode}"
    return (f"time({ft.round_seconds:g}s, {ft.min_inner_steps}-{ft.max_inner_steps} steps, "
            f"{tokens_per_step} tokens/step) {ft.outer_weighting}{mode}")


def describe(fp: dict[str, Any]) -> str:
    """One line naming the island and what it trains (a peer's fingerprint may lack fields)."""
    f = {k: fp.get(k, "?") for k in ("island", "ranks", "model", "params", "shapes", "sync_width",
                                     "num_fragments", "semi_sync_method", "outer", "pacing", "codec",
                                     "start", "inner_state", "federation")}
    params = f"{f['params']:,}" if isinstance(f["params"], int) else str(f["params"])
    return (f"island {f['island']} ({f['ranks']} rank(s)): {f['model']}, {params} parameters "
            f"(shapes {f['shapes']}), sync_width {f['sync_width']}, {f['num_fragments']} fragment(s), "
            f"{f['semi_sync_method']} {f['outer']}, pacing {f['pacing']}, codec {f['codec']}, "
            f"start {f['start']}, inner optimizer state {f['inner_state']}, {f['federation']}")


def members_compute(table: list[dict[str, Any]]) -> str:
    """What each member of a quorum computes with, as it declared it (a peer's text, so cut
    to 80 printable characters): `island 0: cpu float32, eager (torch 2.13.0); island 1: ...`."""
    def text(value: Any) -> str:
        return "".join(c for c in str(value) if c.isprintable())[:80] if value not in (None, "") else "undeclared"
    return "; ".join(f"island {text(fp.get('island', '?'))}: {text(fp.get('compute'))}" for fp in table)


def differing(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """The fingerprint fields two islands must agree on and do not."""
    return [k for k in FINGERPRINT_KEYS if mine.get(k) != theirs.get(k)]


def fingerprint_groups(table: list[dict[str, Any]]) -> list[int]:
    """Numbers the distinct fingerprints of `table` (equal numbers: equal on every field
    islands must agree on, the ones `differing` compares)."""
    seen: dict[str, int] = {}
    keys = [json.dumps([fp.get(k) for k in FINGERPRINT_KEYS], sort_keys=True, default=str) for fp in table]
    return [seen.setdefault(key, len(seen)) for key in keys]


def mismatch(mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """Why two islands cannot train together, or None."""
    keys = differing(mine, theirs)
    if not keys:
        return None
    hint = (" sync_width must be equal on every island and at most the smallest island's rank count."
            if "sync_width" in keys else "")
    return (f"{describe(mine)} does not match {describe(theirs)} (differs in: {', '.join(keys)}); "
            f"start every island with the same model and [fault_tolerance] settings.{hint}")


_ROW = 1024  # bytes per island in the exchange: its fingerprint's JSON, in a join frame with a key
JOIN = 6     # trust frame kind: an island's fingerprint at one quorum (its join frame)
UNREADABLE = {"island": "?", "ranks": 0, "model": "unknown", "params": 0, "shapes": "?", "sync_width": "?",
              "num_fragments": "?", "semi_sync_method": "?", "outer": "?"}


def fingerprint_row(mine: dict[str, Any], key: FederationKey | None, quorum: int) -> bytes:
    """An island's row of the fingerprint exchange: its JSON, and with a key a join frame
    (signed, bound to this quorum) around it."""
    raw = json.dumps(mine, sort_keys=True).encode()
    if key is not None:
        island = mine.get("island", 0)
        raw = seal(key, FrameHeader(quorum, 0, 0, island if isinstance(island, int) else 0, JOIN), raw)
    if len(raw) > _ROW:
        raise ConfigError(f"this island's fingerprint takes {len(raw)} bytes, more than the {_ROW} the join "
                          "exchange carries; use a shorter model name")
    return raw


def read_fingerprint_row(data: bytes, key: FederationKey | None, quorum: int) -> dict[str, Any]:
    """A peer's fingerprint from its row. With a key, one without a valid join frame for
    this quorum (another key, none, or a replay) is `{"unauthenticated": True, ...}`, read
    no further; a row that is not a fingerprint (an old version) is UNREADABLE."""
    if key is not None:
        try:
            header, data = open_frame(key, data, FrameHeader(quorum, 0, 0, 0, JOIN), any_island=True)
        except FrameRefused:
            return {**UNREADABLE, "unauthenticated": True}
    try:
        fp = json.loads(data.decode())
    except ValueError:
        return dict(UNREADABLE)
    if not isinstance(fp, dict) or (key is not None and fp.get("island") != header.island):
        return {**UNREADABLE, "unauthenticated": True} if key is not None else dict(UNREADABLE)
    return fp


def exchange_fingerprints(manager: Any, mine: dict[str, Any],
                          key: FederationKey | None = None) -> list[dict[str, Any]] | None:
    """Every participant's fingerprint, through one all-gather on the cross-island group.

    Each island sends one row: the length of its `fingerprint_row` (2 bytes, big-endian),
    the row, zero padding. An all-gather, not a sum: no member can write into another's
    row. Returns None if the collective failed (the manager has recorded the error and the
    round will not commit).
    """
    quorum = int(manager._quorum_id or 0)
    rows = _all_gather_rows(manager, fingerprint_row(mine, key, quorum))
    return None if rows is None else [read_fingerprint_row(row, key, quorum) for row in rows]


CLAIM = 7  # trust frame kind: an island's claim about its own state (policy.StateClaim) at one quorum


def claim_row(claim: StateClaim, island: int, key: FederationKey | None, quorum: int) -> bytes:
    """An island's state claim as JSON, with a key in a signed frame bound to this quorum."""
    raw = json.dumps({**asdict(claim), "island": island}, sort_keys=True).encode()
    return seal(key, FrameHeader(quorum, 0, 0, island, CLAIM), raw) if key is not None else raw


def read_claim_row(data: bytes, key: FederationKey | None, quorum: int) -> StateClaim:
    """A peer's claim; one that is unsigned, replayed or malformed claims nothing (step -1)."""
    try:
        if key is not None:
            _, data = open_frame(key, data, FrameHeader(quorum, 0, 0, 0, CLAIM), any_island=True)
        raw = json.loads(data.decode())
        return StateClaim(step=claimed_step(raw), digest=str(raw["digest"])[:64], current=raw["current"] is True,
                          inner_step=_whole(raw["inner_step"]), federation_tokens=_whole(raw["federation_tokens"]))
    except (FrameRefused, ValueError, KeyError, TypeError, AttributeError):
        return StateClaim()


def _whole(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"not a whole number: {value!r}")
    return value


def exchange_claims(manager: Any, claim: StateClaim, island: int,
                    key: FederationKey | None = None) -> list[StateClaim] | None:
    """Every participant's state claim, by replica rank (one all-gather of ~300 bytes per
    island on this bridge rank's cross-island group); None if the collective failed."""
    quorum = int(manager._quorum_id or 0)
    rows = _all_gather_rows(manager, claim_row(claim, island, key, quorum))
    return None if rows is None else [read_claim_row(row, key, quorum) for row in rows]


def _all_gather_rows(manager: Any, raw: bytes) -> list[bytes] | None:
    """Every participant's `raw` bytes (at most _ROW), by replica rank; None if the
    collective failed or this island is not in the quorum."""
    from archipelago.federation.exchange import allgather, wire_device

    count, me = manager.num_participants(), manager.participating_rank()
    if me is None or count < 1:
        return None
    row = torch.zeros(_ROW + 2, dtype=torch.uint8)
    row[:2] = torch.tensor(list(len(raw).to_bytes(2, "big")), dtype=torch.uint8)
    row[2:2 + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    # NCCL carries device tensors only: the row goes to this rank's GPU there (gloo: host memory).
    here = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    work, outputs = allgather(manager, row.to(wire_device(manager, here)), count)
    work.wait()
    if manager.errored() is not None:
        return None
    return [_row_bytes(out) for out in outputs]


def _row_bytes(row: torch.Tensor) -> bytes:
    """The bytes a peer wrote into its row (empty if its length field does not fit)."""
    data = bytes(row.cpu().tolist())
    size = int.from_bytes(data[:2], "big")
    return data[2:2 + size] if size <= _ROW else b""

"""The outer loop and the bridge, against references: torchft's DiLoCo, full tensors.

Islands here are threads of this process (one rank each) with an in-process
lighthouse, as torchft's own integration tests do; multi-rank islands are spawned
processes.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import threading
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import rank_manager, spawn_ranks
from test_island import _free_port, fsdp_on_two_ranks, tiny_model, two_rank_island
from torch import nn

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation import split_fragments
from archipelago.federation.diloco import OuterLoop
from archipelago.federation.layout import FlatLayout
from archipelago.federation.membership import (
    FederationMismatch,
    LighthouseUnreachable,
    fingerprint,
    mismatch,
    wait_for_lighthouse,
)

VOCAB, SEQ, BATCH = 64, 16, 4
_INIT = threading.Lock()  # model init seeds torch's global RNG: one thread at a time


def _model() -> nn.Module:
    with _INIT:
        return tiny_model("cpu", seed=3)


def _batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * replica + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _inner_step(model: nn.Module, opt: torch.optim.Optimizer, replica: int, step: int) -> None:
    x, y = _batch(replica, step)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()


def _manager(lighthouse: str, replica: int, stores: list, ours: bool = False, key=None):
    """A torchft Manager; `ours`: with the platform's healing transport (torchft's own otherwise)."""
    from torch.distributed import TCPStore
    from torchft import Manager
    from torchft.process_group import ProcessGroupGloo

    from archipelago.federation.membership import _checkpoint_transport

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    stores.append(store)  # keep it alive as long as the manager
    timeout = timedelta(seconds=20)
    return Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None,
                   state_dict=None, min_replica_size=2, use_async_quorum=False,
                   timeout=timeout, quorum_timeout=timedelta(seconds=30),
                   connect_timeout=timedelta(seconds=10), rank=0, world_size=1,
                   store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=lighthouse,
                   replica_id=f"island_{replica}",
                   checkpoint_transport=_checkpoint_transport(timeout, key, replica) if ours else None)


def _ours(ft: FaultToleranceConfig, lighthouse: str, replica: int, steps: int, out: dict, key=None) -> None:
    stores: list = []
    manager = _manager(lighthouse, replica, stores, ours=True, key=key)
    try:
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        # Token weights need token counts: island r trains (r + 1) x 512 per step (equal
        # weights ignore them), so the average is not the plain mean.
        tokens = 512 * (replica + 1)
        fp = fingerprint("tiny", [(n, tuple(p.shape)) for n, p in model.named_parameters()], ft, 1,
                         tokens_per_step=tokens, inner_lr=1e-2)
        outer = OuterLoop(replace(ft, replica_id=replica), split_fragments(model, ft.num_fragments),
                          0, 1, manager, fp, key=key, optimizer=opt if ft.average_optimizer_state else None)
        healed, codecs = False, []
        for step in range(1, steps + 1):
            _inner_step(model, opt, replica, step)
            report = outer.after_inner_step(step, tokens)
            healed = healed or outer.healed
            if report is not None:
                codecs.append(report.codec)
        out[replica] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[f"step{replica}"], out[f"healed{replica}"], out[f"codecs{replica}"] = outer.outer_step, healed, codecs
        out[f"moments{replica}"] = torch.cat([opt.state[p]["exp_avg_sq"].flatten() for p in model.parameters()])
    finally:
        manager.shutdown(wait=False)


class _Fragment(nn.Module):
    """A module holding some of the model's own parameters (what torchft's DiLoCo wants)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        self.params = nn.ParameterList(params)


def _torchft(ft: FaultToleranceConfig, lighthouse: str, replica: int, steps: int, out: dict) -> None:
    from torchft.local_sgd import DiLoCo

    stores: list = []
    manager = _manager(lighthouse, replica, stores)
    try:
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        fragments = [_Fragment(ps) for ps in split_fragments(model, ft.num_fragments)]
        outer = [torch.optim.SGD(f.parameters(), lr=ft.outer_lr, momentum=ft.outer_momentum,
                                 nesterov=True) for f in fragments]
        with DiLoCo(manager, fragments, opt, outer, sync_every=ft.sync_steps,
                    fragment_sync_delay=ft.fragment_sync_delay,
                    fragment_update_alpha=ft.fragment_update_alpha):
            for step in range(1, steps + 1):
                _inner_step(model, opt, replica, step)
        out[replica] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[f"step{replica}"] = manager.current_step()
    finally:
        manager.shutdown(wait=False)


def _run_islands(target, ft: FaultToleranceConfig, steps: int) -> dict:
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=2000)
    out: dict = {}
    try:
        threads = [threading.Thread(target=target, args=(ft, lighthouse.address(), r, steps, out),
                                    daemon=True) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=150)
        assert not any(t.is_alive() for t in threads), "an island thread hung"
    finally:
        lighthouse.shutdown()
    assert 0 in out and 1 in out, f"an island failed: {sorted(map(str, out))}"
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("target_s,rides", [(60.0, True), (1e-9, False)], ids=["link-carries", "link-too-thin"])
def test_auto_sends_the_averaged_moments_only_over_a_link_that_carries_them(target_s, rides):
    ft = FaultToleranceConfig(enable=True, group_size=2, min_replica_size=2, sync_steps=2, codec="auto",
                              average_optimizer_state=True, target_exchange_s=target_s)
    out = _run_islands(_ours, ft, steps=6)
    labels = out["codecs0"]
    assert labels == out["codecs1"] and len(labels) == 3, out  # both islands chose alike, every round
    assert labels[0] == "auto:int8"  # before any island measured the link: int8, no moments
    if rides:  # in-process, the link carries anything: fp32 with the moments from the second round
        assert labels[1:] == ["auto:fp32+moments"] * 2, labels
        assert torch.equal(out["moments0"], out["moments1"])  # the last round left both the same average
    else:  # nothing fits a target of 1 ns: the fewest bytes, the moments held back
        assert all("+moments" not in label for label in labels), labels
        assert not torch.equal(out["moments0"], out["moments1"])  # each island kept its own


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fragments,delay,alpha", [(1, 0, 0.0), (2, 1, 0.5)],
                         ids=["diloco", "streaming-2-fragments"])
def test_matches_torchft_diloco_on_homogeneous_islands(fragments, delay, alpha):
    ft = FaultToleranceConfig(enable=True, group_size=2, min_replica_size=2, sync_steps=4,
                              outer_weighting="equal",  # plain DiLoCo, as torchft
                              outer_lr=0.7, outer_momentum=0.9,  # torchft's examples: Nesterov momentum
                              num_fragments=fragments, fragment_sync_delay=delay,
                              fragment_update_alpha=alpha)
    steps = 12  # three rounds of every fragment
    ours, theirs = _run_islands(_ours, ft, steps), _run_islands(_torchft, ft, steps)
    assert ours["step0"] == theirs["step0"] == steps // (ft.sync_steps // fragments)
    start = dict(tiny_model("cpu", seed=3).named_parameters())
    for name, tensor in theirs[0].items():
        assert not torch.equal(tensor, start[name].detach()), f"{name} never trained"
        torch.testing.assert_close(ours[0][name], tensor, rtol=0, atol=1e-6, msg=name)
        torch.testing.assert_close(ours[1][name], theirs[1][name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("keyed", [False, True], ids=["no-key", "federation-key"])
def test_healing_takes_the_global_state_from_a_peer_without_unpickling(monkeypatch, keyed):
    from archipelago.federation.trust import FederationKey

    def forbidden(*args, **kwargs):
        raise AssertionError("unpickling on the healing path")

    for module, name in ((pickle, "loads"), (pickle, "load"), (torch, "load")):
        monkeypatch.setattr(module, name, forbidden)
    ft = FaultToleranceConfig(enable=True, group_size=2, min_replica_size=2, sync_steps=4)
    key = FederationKey(os.urandom(32)) if keyed else None  # signed request and answer
    out = _run_islands(functools.partial(_ours, key=key), ft, 8)
    # The first round: island 1 takes island 0's start state (init_sync) through the transport.
    assert out["healed1"] and not out["healed0"] and out["step0"] == out["step1"] == 2
    for name, tensor in out[0].items():
        assert torch.equal(tensor, out[1][name]), name


# ---- the bridge: canonical layout under FSDP ------------------------------------------


def _layout_worker(rank: int, port: int, width: int, out: dict) -> None:
    with fsdp_on_two_ranks(rank, port, "cpu", seed=5) as parallel:
        params = list(parallel.module.parameters())
        layout = FlatLayout(params, width, rank, 2)
        chunk = layout.gather()
        out[f"chunk{rank}"] = None if chunk is None else chunk.clone()
        layout.scatter(None if chunk is None else chunk * 2 + rank)  # marks which bridge wrote
        out[f"after{rank}"] = torch.cat([p.full_tensor().detach().flatten() for p in params])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("width", [1, 2])
def test_bridge_gathers_the_canonical_layout_and_scatters_back_into_fsdp_shards(width):
    flat = torch.cat([p.detach().flatten() for p in tiny_model("cpu", seed=5).parameters()])
    with rank_manager() as manager:
        out = manager.dict()
        spawn_ranks(_layout_worker, args=(_free_port(), width, out), nprocs=2)
        out = dict(out)
    size = -(-flat.numel() // width)
    expected_after = flat.clone() * 2
    for s in range(width):
        lo, hi = s * size, min((s + 1) * size, flat.numel())
        assert torch.equal(out[f"chunk{s}"], flat[lo:hi]), f"chunk {s}"
        expected_after[lo:hi] += s
    assert width == 2 or out["chunk1"] is None
    for rank in range(2):
        assert torch.equal(out[f"after{rank}"], expected_after)


def _stage_layout_worker(rank: int, port: int, width: int, out: dict) -> None:
    with two_rank_island(rank, port):
        model = tiny_model("cpu", seed=5)
        params = list(model.parameters())
        split = len(params) // 3  # rank 0 holds the first third (a stage), rank 1 the rest
        mine = range(split) if rank == 0 else range(split, len(params))
        held = [p if i in mine else torch.empty_like(p, device="meta") for i, p in enumerate(params)]
        layout = FlatLayout(held, width, rank, 2)
        chunk = layout.gather()
        out[f"chunk{rank}"] = None if chunk is None else chunk.clone()
        layout.scatter(None if chunk is None else chunk * 2 + rank)
        out[f"after{rank}"] = {i: params[i].detach().clone() for i in mine}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("width", [1, 2])
def test_bridge_takes_each_parameter_from_the_stage_that_holds_it(width):
    """Pipeline stages: each parameter lives on one rank only, yet the bridge ranks' chunks
    are the canonical flat vector, and each stage gets back exactly its parameters."""
    params = list(tiny_model("cpu", seed=5).parameters())
    flat = torch.cat([p.detach().flatten() for p in params])
    with rank_manager() as manager:
        out = manager.dict()
        spawn_ranks(_stage_layout_worker, args=(_free_port(), width, out), nprocs=2)
        out = dict(out)
    size = -(-flat.numel() // width)
    expected = flat.clone() * 2
    for s in range(width):
        lo, hi = s * size, min((s + 1) * size, flat.numel())
        assert torch.equal(out[f"chunk{s}"], flat[lo:hi]), f"chunk {s}"
        expected[lo:hi] += s
    offsets = [0]
    for p in params:
        offsets.append(offsets[-1] + p.numel())
    for rank in range(2):
        for i, tensor in out[f"after{rank}"].items():
            assert torch.equal(tensor.flatten(), expected[offsets[i]:offsets[i + 1]]), (rank, i)


def test_bridge_refuses_a_parameter_no_rank_holds():
    params = [torch.empty(3, device="meta"), torch.zeros(2)]
    with pytest.raises(ValueError, match=r"parameters \[0\] are held by no rank"):
        FlatLayout(params, 1, 0, 1)


def test_bridge_on_one_rank_is_a_plain_copy():
    model = tiny_model("cpu", seed=1)
    layout = FlatLayout(list(model.parameters()), 1, 0, 1)
    chunk = layout.gather()
    assert torch.equal(chunk, torch.cat([p.detach().flatten() for p in model.parameters()]))
    layout.scatter(torch.zeros_like(chunk))
    assert all(not p.detach().any() for p in model.parameters())
    with pytest.raises(ValueError, match="sync_width 2"):
        FlatLayout(list(model.parameters()), 2, 0, 1)


# ---- fragments, fingerprints, lighthouse ---------------------------------------------


def test_fragments_are_contiguous_layers_with_embeddings_first_and_output_last():
    model = tiny_model("cpu")
    names = {id(p): n for n, p in model.named_parameters()}
    fragments = split_fragments(model, 2)
    first, last = [names[id(p)] for p in fragments[0]], [names[id(p)] for p in fragments[1]]
    assert first[0].startswith("tok_embeddings") and all("layers.1." not in n for n in first)
    assert any(n.startswith("output") for n in last) and all("layers.0." not in n for n in last)
    assert sum(map(len, fragments)) == len(list(model.parameters()))
    with pytest.raises(ValueError, match="num_fragments = 3"):
        split_fragments(model, 3)


def test_a_resnet_splits_into_fragments_by_residual_block_stem_first_classifier_last():
    from archipelago.models.resnet import FLAVORS, build_resnet

    model = build_resnet(FLAVORS["debug"])
    names = {id(p): n for n, p in model.named_parameters()}
    blocks = list(dict.fromkeys(n.split(".")[0] + "." + n.split(".")[1] for n in names.values()
                                if n.startswith("layer")))  # layer1.0, layer1.1, ..., in model order
    fragments = [[names[id(p)] for p in f] for f in split_fragments(model, len(blocks))]
    assert fragments[0][0].startswith("conv1") and fragments[-1][-1].startswith("fc")
    for block, fragment in zip(blocks, fragments):  # one residual block each, in order
        inside = [n for n in fragment if n.startswith("layer")]
        assert inside and all(n.startswith(block + ".") for n in inside), (block, fragment)
    assert sum(map(len, fragments)) == len(names)
    with pytest.raises(ValueError, match=f"exceeds the model's {len(blocks)} layers"):
        split_fragments(model, len(blocks) + 1)


def test_fingerprint_mismatch_names_both_islands():
    ft = FaultToleranceConfig(enable=True, group_size=2)
    a = fingerprint("llama3/debug", [("w", (4, 4))], ft, 2)
    b = fingerprint("llama3/small", [("w", (8, 4))], replace(ft, replica_id=1, sync_width=2), 1)
    assert mismatch(a, dict(a, ranks=7, island=3)) is None  # rank counts may differ
    message = mismatch(a, b)
    assert "island 0" in message and "island 1" in message and "llama3/small" in message
    assert "sync_width" in message and "smallest island" in message
    assert issubclass(FederationMismatch, Exception)


def test_islands_must_agree_on_the_topk_early_rounds():
    # A member sending another count a chunk would send payloads of another length: refused
    # at the join, naming the codec, not as forged rows every round.
    ft = FaultToleranceConfig(enable=True, group_size=2, codec="topk", topk_fraction=0.01, topk_chunk_size=1024,
                              topk_early_fraction=0.02, topk_early_rounds=20)
    shapes = [("w", (4, 4))]
    a = fingerprint("m", shapes, ft, 1)
    assert "0.02 in the first 20 rounds" in a["codec"]
    assert mismatch(a, fingerprint("m", shapes, replace(ft, replica_id=1), 1)) is None
    for other in (replace(ft, topk_early_rounds=10), replace(ft, topk_early_fraction=0.03),
                  replace(ft, topk_early_fraction=0.0, topk_early_rounds=0)):
        message = mismatch(a, fingerprint("m", shapes, replace(other, replica_id=1), 1))
        assert message is not None and "codec" in message, other


def test_time_paced_islands_must_agree_on_the_round_and_the_token_budget():
    ft = FaultToleranceConfig(enable=True, group_size=2, round_pacing="time", round_seconds=30)
    shapes = [("w", (4, 4))]
    a = fingerprint("m", shapes, ft, 2, tokens_per_step=4096)
    assert mismatch(a, fingerprint("m", shapes, replace(ft, replica_id=1), 1, tokens_per_step=4096)) is None
    for other, tokens in ((replace(ft, round_seconds=20), 4096), (ft, 2048),
                          (replace(ft, outer_weighting="equal"), 4096), (replace(ft, round_pacing="steps"), 4096)):
        message = mismatch(a, fingerprint("m", shapes, replace(other, replica_id=1), 1, tokens_per_step=tokens))
        assert message is not None and "pacing" in message, (other, tokens)
    # Under step pacing an island's batch may differ: only the step count is shared.
    steps = replace(ft, round_pacing="steps")
    assert mismatch(fingerprint("m", shapes, steps, 2, 4096), fingerprint("m", shapes, steps, 1, 2048)) is None


@pytest.mark.timeout(30)
def test_unreachable_lighthouse_fails_within_the_connect_timeout():
    port = _free_port()  # nothing listens there
    with pytest.raises(LighthouseUnreachable, match="archipelago lighthouse"):
        wait_for_lighthouse(f"http://127.0.0.1:{port}", timeout_s=1.0)


def test_nccl_is_refused_where_it_would_be_handed_cpu_tensors():
    from archipelago.config import ConfigError
    from archipelago.federation import check_exchange_device

    nccl = FaultToleranceConfig(enable=True, process_group="nccl")
    with pytest.raises(ConfigError, match='use process_group = "tcp"'):
        check_exchange_device(nccl, torch.device("cpu"))
    with pytest.raises(ConfigError, match="copy_pseudogradients_to_cpu = false"):
        check_exchange_device(replace(nccl, copy_pseudogradients_to_cpu=True), torch.device("cuda"))
    check_exchange_device(nccl, torch.device("cuda"))  # GPU buffers: fine
    check_exchange_device(replace(nccl, process_group="gloo", copy_pseudogradients_to_cpu=True),
                          torch.device("cpu"))


# ---- golden numbers: a few rounds of our own outer step, pinned --------------------------

GOLDEN = Path(__file__).resolve().parent / "golden" / "diloco_rounds.json"
REGENERATE = "ARCHIPELAGO_REGENERATE_GOLDEN"


def _fingerprint_of(weights: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """Per parameter: its sum, its sum of squares and its first three values (float64)."""
    return {name: [float(t.double().sum()), float(t.double().square().sum()), *map(float, t.flatten()[:3])]
                   for name, t in sorted(weights.items())}


@pytest.mark.timeout(240)
def test_diloco_rounds_match_the_golden_numbers():
    # Token weights, the default plain averaging, 3 rounds of 4 steps between two islands.
    # Any change to what a round computes moves these numbers; if the change is intended,
    # regenerate with ARCHIPELAGO_REGENERATE_GOLDEN=1 and say why in the commit.
    ft = FaultToleranceConfig(enable=True, group_size=2, min_replica_size=2, sync_steps=4)
    out = _run_islands(_ours, ft, 12)
    got = {"island0": _fingerprint_of(out[0]), "island1": _fingerprint_of(out[1]), "outer_steps": out["step0"]}
    if os.environ.get(REGENERATE):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=1) + "\n")
        pytest.skip(f"regenerated {GOLDEN}")
    want = json.loads(GOLDEN.read_text())
    assert got["outer_steps"] == want["outer_steps"] == 3
    start = _fingerprint_of(dict(tiny_model("cpu", seed=3).named_parameters()))
    assert all(got["island0"][name] != start[name] for name in start)  # every parameter moved
    assert got["island0"] == got["island1"]  # both hold the global weights, bit for bit
    # 1e-5: two x86 machines (their matmul kernels round differently) ended up to 2.4e-6
    # apart after the 12 inner AdamW steps; a change to what a round computes moves these
    # numbers by orders of magnitude more.
    for name, values in want["island0"].items():
        assert got["island0"][name] == pytest.approx(values, rel=1e-5, abs=1e-5), name

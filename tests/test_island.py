"""Parallelism applied from outside the model: initialisation, sharding, wrappers."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from conftest import rank_manager, spawn_ranks

from archipelago.island.device import IslandContext, detect_device_type
from archipelago.island.parallelize import ParallelModel, compute_dtype, parallelize
from archipelago.models import build_model, get_model_args


def tiny_model(device="cpu", seed=0):
    args = get_model_args("llama3", "debug", vocab_size=64)
    args.n_layers, args.dim, args.n_heads, args.n_kv_heads, args.ffn_dim = 2, 32, 4, 2, 64
    args.max_seq_len = 16
    model = build_model(args, device="meta")
    if device != "meta":
        model.to_empty(device=device)
        model.init_weights(seed=seed)
    return model


def one_rank() -> IslandContext:
    return IslandContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")


def test_compute_dtype_is_bf16_on_accelerators_and_fp32_on_cpu():
    assert compute_dtype("auto", torch.device("cpu")) == torch.float32
    assert compute_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert compute_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    assert compute_dtype("fp32", torch.device("cuda", 0)) == torch.float32


def test_cpu_is_always_available():
    assert detect_device_type("cpu") == "cpu"
    assert detect_device_type("auto") in ("cpu", "cuda", "xpu", "mps")


def test_meta_model_is_materialised_like_a_cpu_initialised_one():
    reference = tiny_model("cpu", seed=3)
    parallel = parallelize(tiny_model("meta"), one_rank(), "fsdp", "auto", seed=3)
    got = dict(parallel.inner.named_parameters())
    for name, param in reference.named_parameters():
        assert torch.equal(got[name], param), name
    assert parallel.strategy == "single"


def test_activation_checkpointing_keeps_loss_and_gradients():
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for checkpointing in (False, True):
        parallel = parallelize(tiny_model("cpu"), one_rank(), "fsdp", "fp32",
                               activation_checkpointing=checkpointing)
        loss = parallel.module(tokens).float().logsumexp(-1).mean()
        loss.backward()
        grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
                 for n, p in parallel.module.named_parameters()}
        results.append((loss.detach(), grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=0, atol=1e-6)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def two_rank_island(rank: int, port: int) -> Iterator[IslandContext]:
    """Rank `rank` of a 2-rank gloo island on 127.0.0.1:`port`; the process group is
    destroyed on exit."""
    torch.set_num_threads(1)  # two ranks share two cores: more threads only wait for each other
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        yield IslandContext(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"), backend="gloo")
    finally:
        torch.distributed.destroy_process_group()


@contextmanager
def fsdp_on_two_ranks(rank: int, port: int, device: str, seed: int) -> Iterator[ParallelModel]:
    """Rank `rank` of a 2-rank gloo island holding tiny_model(device, seed) sharded with FSDP2."""
    with two_rank_island(rank, port) as ctx:
        yield parallelize(tiny_model(device, seed=seed), ctx, "fsdp", "auto", seed=seed)


def _fsdp_worker(rank: int, port: int, meta: bool, out: dict) -> None:
    with fsdp_on_two_ranks(rank, port, "meta" if meta else "cpu", seed=5) as parallel:
        full = {n: p.full_tensor().detach().clone() for n, p in parallel.module.named_parameters()}
        local = {n: p.to_local().numel() for n, p in parallel.module.named_parameters()}
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
        parallel.module(tokens).sum().backward()
        out[rank] = (full, local, all(p.grad is not None for p in parallel.module.parameters()))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("meta", [False, True], ids=["cpu-init", "meta-init"])
def test_fsdp_shards_every_block_and_initialises_consistently(meta):
    with rank_manager() as manager:
        out = manager.dict()
        spawn_ranks(_fsdp_worker, args=(_free_port(), meta, out), nprocs=2)
        (full0, local0, grads0), (full1, local1, grads1) = out[0], out[1]
    assert grads0 and grads1
    reference = dict(tiny_model("cpu", seed=5).named_parameters())
    for name, tensor in full0.items():
        # Both ranks see the same full weights, and each holds only part of them.
        assert torch.equal(tensor, full1[name]), name
        assert local0[name] < tensor.numel() or tensor.shape[0] < 2, name
        assert local0[name] + local1[name] == tensor.numel(), name
        assert torch.isfinite(tensor).all(), name
        if not meta:  # a CPU-initialised model is sharded as is: same weights as 1 rank
            assert torch.equal(tensor, reference[name].detach()), name
    if meta:  # initialised shard by shard: the statistics of the reference init hold
        w = full0["layers.0.attention.wq.weight"]
        assert 0.015 < w.std().item() < 0.025


def _resnet_worker(rank: int, port: int, out: dict) -> None:
    from archipelago.models import get_image_model_args
    from archipelago.models.resnet import build_resnet

    with two_rank_island(rank, port) as ctx:
        model = build_resnet(get_image_model_args("resnet", "debug"), "cpu")
        parallel = parallelize(model, ctx, "fsdp", "fp32", seed=0)
        images = torch.randn(4, 1, 28, 28, generator=torch.Generator().manual_seed(rank)) * (1 + rank)
        parallel.module(images).sum().backward()  # train mode: each rank's statistics of its own images
        before = {n: b.clone() for n, b in parallel.inner.named_buffers() if "running" in n}
        parallel.average_buffers()
        after = {n: b.clone() for n, b in parallel.inner.named_buffers() if "running" in n}
        units = [type(parallel.inner.get_submodule(f"layer{k}")).__name__ for k in range(1, 5)]
        norms = sum(isinstance(m, torch.nn.BatchNorm2d) for m in parallel.inner.modules())
        out[rank] = (before, after, units, norms)


@pytest.mark.timeout(120)
def test_resnet_stages_are_fsdp_units_and_batchnorm_statistics_are_averaged_over_ranks():
    with rank_manager() as manager:
        out = manager.dict()
        spawn_ranks(_resnet_worker, args=(_free_port(), out), nprocs=2)
        (before0, after0, units, norms), (before1, after1, _, _) = out[0], out[1]
    assert all(u.startswith("FSDP") for u in units), units  # each stage is one FSDP unit
    assert before0.keys() == after0.keys() and len(before0) == 2 * norms == 2 * 12  # mean and variance
    differed = 0
    for name in before0:
        differed += not torch.equal(before0[name], before1[name])
        torch.testing.assert_close(after0[name], (before0[name] + before1[name]) / 2, rtol=0, atol=1e-6)
        assert torch.equal(after0[name], after1[name]), name
    assert differed == len(before0)  # the ranks saw different images: every statistic moved apart


def _moe_args(family: str):  # noqa: ANN202
    from archipelago.models.gpt_oss import GptOssArgs
    from archipelago.models.qwen3_moe import Qwen3MoeArgs

    if family == "gpt_oss":
        return GptOssArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, vocab_size=64, ffn_dim=16,
                          n_experts=4, top_k=2, sliding_window=4, max_seq_len=32)
    return Qwen3MoeArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, vocab_size=64, ffn_dim=64,
                        n_experts=4, top_k=2, moe_ffn_dim=16, qk_norm=True, max_seq_len=32)


def _expert_parallel_worker(rank: int, port: int, family: str, out: dict) -> None:
    from archipelago.models import build_model

    with two_rank_island(rank, port) as ctx:
        args = _moe_args(family)
        torch.manual_seed(0)
        model = build_model(args, device="cpu")
        model.init_weights(seed=0)
        parallel = parallelize(model, ctx, "fsdp", "fp32", seed=0, expert_parallel=True)
        tokens = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(7))[2 * rank:2 * rank + 2]
        logits = parallel.module(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten()).backward()
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                 for n, p in parallel.module.named_parameters()}
        block = parallel.inner.layers[0]
        moe = block.moe if family == "gpt_oss" else block.feed_forward
        local = moe.experts.gate_up.to_local().shape[0]
        out[rank] = (logits.detach().clone(), grads, local)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_expert_parallel_equals_one_rank_with_the_whole_batch(family):
    from archipelago.models import build_model

    with rank_manager() as manager:
        out = manager.dict()
        spawn_ranks(_expert_parallel_worker, args=(_free_port(), family, out), nprocs=2)
        (logits0, grads0, local), (logits1, grads1, _) = out[0], out[1]
    assert local == 2  # each rank holds half of the 4 experts
    args = _moe_args(family)
    model = build_model(args, device="cpu")
    model.init_weights(seed=0)
    tokens = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(7))
    logits = model(tokens)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten()).backward()
    torch.testing.assert_close(torch.cat([logits0, logits1]), logits.detach(), rtol=0, atol=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads0[name], param.grad, rtol=0, atol=1e-5, msg=name)
        torch.testing.assert_close(grads1[name], param.grad, rtol=0, atol=1e-5, msg=name)

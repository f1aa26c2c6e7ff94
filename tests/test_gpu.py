"""GPU paths: bf16 compute, NCCL, FSDP2 on CUDA, meta-device init of a >1B model.

Run with `make test-gpu` on a machine with CUDA; skipped elsewhere.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY, losses, run_cli

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def train(run_dir, *extra, nproc=1, timeout=400):
    return run_cli(["train", *TINY, "--nproc", str(nproc), "--job.run_dir", str(run_dir),
                    "--training.device", "cuda", *extra], timeout=timeout)


def test_bf16_training_on_one_gpu_learns(shakespeare, tmp_path):
    run = tmp_path / "run"
    done = train(run, "--training.steps", "40", "--metrics.log_every", "1", "--optimizer.lr", "3e-3",
                 "--checkpoint.no_enable")
    assert done.returncode == 0, done.output[-3000:]
    assert "torch.bfloat16" in (run / "train.log").read_text()
    curve = losses(run)
    assert curve[1] > 8.0 and curve[40] < curve[1] - 1.5, curve
    summary = json.loads((run / "summary.json").read_text())
    assert summary["device"] == "cuda" and summary["peak_source"] != "measured matmul peak"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL")
def test_fsdp_over_nccl_matches_one_gpu(shakespeare, tmp_path):
    common = ["--training.steps", "6", "--metrics.log_every", "1", "--training.val_every", "0",
              "--checkpoint.no_enable"]
    one = train(tmp_path / "one", *common)
    two = train(tmp_path / "two", *common, nproc=2)
    assert one.returncode == 0 and two.returncode == 0, two.output[-3000:]
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    for step in a:  # bf16 compute: reduction order differences are larger than in fp32
        assert b[step] == pytest.approx(a[step], abs=3e-2), (step, a, b)


def test_billion_parameter_model_is_initialised_on_meta_and_trains(shakespeare, tmp_path):
    run = tmp_path / "run"
    done = train(run, "--model.name", "qwen3", "--model.flavor", "1.7B", "--training.steps", "3",
                 "--training.batch_size", "2", "--metrics.log_every", "1", "--training.val_every", "0",
                 "--checkpoint.no_enable", "--training.activation_checkpointing")
    assert done.returncode == 0, done.output[-3000:]
    curve = losses(run)
    assert all(torch.isfinite(torch.tensor(v)) for v in curve.values()), curve


def test_pseudo_gradients_on_the_gpu_or_copied_to_cpu_give_the_same_federation(shakespeare, tmp_path):
    from test_federation_e2e import _federation, _final_weights

    # Two islands on the one GPU, joined by gloo: the exchange buffer on the GPU (the
    # default) and in host memory (copy_pseudogradients_to_cpu) must train the same model.
    gpu = _federation(tmp_path, "gpu", "1,1", "--training.device", "cuda")
    cpu = _federation(tmp_path, "cpu", "1,1", "--training.device", "cuda",
                      "--fault_tolerance.copy_pseudogradients_to_cpu")
    assert gpu["global_hash_agree"] and cpu["global_hash_agree"]
    a, b = _final_weights(tmp_path / "gpu" / "island-0"), _final_weights(tmp_path / "cpu" / "island-0")
    assert a.keys() == b.keys() and len(a) > 10
    for name in a:  # bf16 inner steps on a GPU need not be bitwise reproducible
        torch.testing.assert_close(a[name], b[name], rtol=1e-2, atol=1e-3, msg=name)


@pytest.mark.parametrize("name", ["bf16", "int8", "topk"])
def test_codecs_encode_the_same_bytes_on_gpu_and_cpu(name):
    from archipelago.config.schema import FaultToleranceConfig
    from archipelago.federation.codecs import build_codec

    ft = FaultToleranceConfig(codec=name, topk_fraction=0.05)
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    on_cpu, on_gpu = build_codec(ft, x.numel()), build_codec(ft, x.numel())
    for _ in range(3):  # top-k: the error feedback must evolve the same way too
        a, b = on_cpu.encode(x), on_gpu.encode(x.cuda())
        assert b.is_cuda and torch.equal(a, b.cpu())
        assert torch.equal(on_cpu.decode(a), on_gpu.decode(b).cpu())


def test_decoupled_reduce_scatter_with_exchange_buffers_on_the_gpu(tmp_path):
    from test_rounds_e2e import _three_judged_in_flight

    # Three islands training on the one GPU, int8, decoupled rounds: the pseudo-gradients are
    # CUDA tensors, encoded there and copied to host memory for gloo's all-to-all; the rows
    # are judged during the round where the second phase starts, the sums decoded
    # back onto the GPU, and every island ends with the same global weights.
    fed, rounds = _three_judged_in_flight(tmp_path / "run", "--training.device", "cuda")
    for k in range(3):
        assert json.loads((tmp_path / "run" / f"island-{k}" / "summary.json").read_text())["device"] == "cuda"
    assert all(r["committed"] for island in rounds for r in island) and len(rounds[0]) >= 4
    assert [r["global_hash"] for r in rounds[0]] == [r["global_hash"] for r in rounds[1]]


def test_a_gpu_island_and_a_cpu_island_train_heal_and_agree(shakespeare, tmp_path):
    # One federation of unlike devices: island 0 on the GPU (bf16 compute), island 1 on the
    # CPU (fp32), gloo between them (the GPU island's pseudo-gradients cross through host
    # memory). The GPU island is SIGKILLed mid-run, restarts from its checkpoint and heals
    # from the CPU island across the device boundary; at the last outer step both
    # committed, their global weights are the same. The kill fires at inner step 30 (six
    # rounds in), not at a wall-clock second, so it lands mid-run however long the GPU takes
    # to start; each island trains 40 s from its join (the steps are many, so no island runs
    # out of them): the CPU island is still training when the GPU island comes back.
    run = tmp_path / "run"
    done = run_cli(["local", "--islands", "1,1", "--no-table", *TINY, "--training.steps", "100000",
                    "--training.time_budget_s", "40", "--fault_tolerance.sync_steps", "5",
                    "--training.val_every", "0", "--checkpoint.interval", "10",
                    "--island-options", "0:--training.device cuda",
                    "--island-options", "1:--training.device cpu --training.mixed_precision fp32",
                    "--kill", "0@step30", "--restart-after", "1", "--job.run_dir", str(run)], timeout=560)
    assert done.returncode == 0, done.output[-4000:]
    fed = json.loads((run / "federation.json").read_text())
    assert [i["restarts"] for i in fed["islands"]] == [1, 0], fed["islands"]
    assert fed["global_hash_agree"], fed["islands"]
    healed = [r for r in fed["outer_steps"] if 0 in r["healed"] and r["outer_step"] > 1]
    assert healed and healed[0]["islands"] == [0, 1], fed["outer_steps"]  # from the CPU island, mid-run
    together = [r for r in fed["outer_steps"] if r["islands"] == [0, 1] and r["outer_step"] > healed[0]["outer_step"]]
    assert len(together) >= 2, fed["outer_steps"]  # both trained on after the heal
    devices = [json.loads((run / f"island-{k}" / "summary.json").read_text())["device"] for k in (0, 1)]
    assert devices == ["cuda", "cpu"]
    log = (run / "island-1" / "train.log").read_text()
    assert "island 0: cuda bfloat16, eager" in log and "island 1: cpu float32, eager" in log

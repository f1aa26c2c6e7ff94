"""Compute backends (training.backend, archipelago/island/backends): the suite every
backend passes against eager PyTorch as the independent reference, and the federation of
unlike backends."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch
from conftest import TINY, run_cli

from archipelago.config import ConfigError, load_config
from archipelago.data import default_cache_dir
from archipelago.federation.membership import fingerprint, members_compute, mismatch
from archipelago.island.backends import BACKENDS, apply_backend, backend, describe_backend
from archipelago.models.registry import build_model, get_model_args
from archipelago.models.resnet import BasicBlock

CPU, FP32 = torch.device("cpu"), torch.float32
VOCAB = 97
# AdamW's rate for the 20 steps: at 3e-3 the loss oscillates and the backends' last-bit
# differences grow to 1e-3 in 20 steps (as any two summation orders would); at 1e-3 it falls
# steadily and they stay below 1e-4.
LR = 1e-3


def _needs(name: str) -> None:
    missing = backend(name).available()
    if missing:
        pytest.skip(missing)


def _llama(seed: int = 0, layers: int | None = None) -> torch.nn.Module:
    """llama3 `debug` (or its first `layers` blocks, where time matters more than depth)."""
    args = get_model_args("llama3", "debug", vocab_size=VOCAB)
    model = build_model(replace(args, n_layers=layers or args.n_layers), device="meta")
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model.float()


def _converted(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, int]:
    twin = copy.deepcopy(model)
    return twin, apply_backend(twin, name, CPU, FP32, default_cache_dir())


def _count_products(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A one-element list counting the products computed through a compiled DaCe program
    from now on (the dace backends' one entry point, dace.matmul)."""
    from archipelago.island.backends import dace as dace_backend

    count, original = [0], dace_backend.matmul

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(dace_backend, "matmul", counted)
    return count


def _worst_relative(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest ||a - b|| / ||b|| over pairs of tensors (b the reference)."""
    return max(float((x - y).norm() / y.norm()) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", list(BACKENDS))
def test_a_backend_computes_llama3_and_its_gradients_as_eager_does(name, monkeypatch):
    _needs(name)
    torch.manual_seed(0)
    eager = _llama()
    model, converted = _converted(eager, name)
    products = _count_products(monkeypatch)
    assert converted == (0 if name == "eager" else sum(isinstance(m, torch.nn.Linear) for m in eager.modules()))
    assert list(model.state_dict()) == list(eager.state_dict())  # names and parameters untouched
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), eager.parameters()))
    tokens = torch.randint(0, VOCAB, (2, 48))
    outputs = []
    for m in (eager, model):
        logits = m(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten()).backward()
        outputs.append(logits.detach())
    assert _worst_relative([outputs[1]], [outputs[0]]) < 1e-5
    assert _worst_relative([p.grad for p in model.parameters()], [p.grad for p in eager.parameters()]) < 1e-5
    # Every converted layer's product ran through the compiled program: once forward, twice
    # backward (the input's and the weight's gradient). Comparing bits would not show it: where
    # the program's BLAS and torch's pick the same kernel, the outputs are equal to the bit.
    assert products == [3 * converted]


@pytest.mark.parametrize("name", list(BACKENDS))
def test_a_backend_computes_a_resnet_block_with_its_projection_as_eager_does(name):
    _needs(name)
    torch.manual_seed(1)
    eager = BasicBlock(8, 16, stride=2).float()  # 3x3 convolutions, one strided, a 1x1 projection
    model, converted = _converted(eager, name)
    assert converted == (0 if name == "eager" else 3)
    images = torch.randn(4, 8, 12, 12, requires_grad=True)
    grads, outputs = [], []
    for m in (eager, model):
        x = images.detach().clone().requires_grad_()
        y = m(x)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outputs.append(y.detach())
        grads.append([x.grad, *(p.grad for p in m.parameters())])
    assert outputs[1].shape == (4, 16, 6, 6)
    assert _worst_relative([outputs[1]], [outputs[0]]) < 1e-5
    assert _worst_relative(grads[1], grads[0]) < 1e-5


@pytest.mark.parametrize("name", list(BACKENDS))
def test_twenty_training_steps_through_a_backend_track_eagers_losses(name):
    _needs(name)
    eager = _llama(seed=3, layers=2)
    model, _ = _converted(eager, name)
    batches = torch.Generator().manual_seed(5)
    # Counting sequences from random starts: learnable, so the losses fall fast.
    data = [(torch.randint(0, VOCAB, (2, 1), generator=batches) + torch.arange(33)) % VOCAB for _ in range(20)]
    losses = []
    for m in (eager, model):
        opt = torch.optim.AdamW(m.parameters(), lr=LR)
        run = []
        for seq in data:
            logits = m(seq[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), seq[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            run.append(loss.item())
        losses.append(run)
    assert losses[0][-1] < losses[0][0] - 0.25  # eager trained: the comparison is about training
    assert max(abs(a - b) for a, b in zip(*losses)) < 1e-4, losses


@pytest.mark.parametrize("name", ["dace", "dace-loops"])
def test_the_dace_backends_refuse_what_they_cannot_compute(name):
    with pytest.raises(ConfigError, match="mixed_precision"):
        load_config([*TINY, "--training.backend", name, "--training.mixed_precision", "bf16"])
    with pytest.raises(ConfigError, match="device"):
        load_config([*TINY, "--training.backend", name, "--training.device", "cuda"])
    with pytest.raises(ConfigError, match="torch.compile"):
        load_config([*TINY, "--training.backend", name, "--training.compile"])
    with pytest.raises(ValueError, match="expected one of eager, dace, dace-loops"):
        backend("tpu")
    _needs(name)
    with pytest.raises(ValueError, match=f"training.backend = \"{name}\" computes on the CPU in float32"):
        apply_backend(_llama(), name, CPU, torch.bfloat16, default_cache_dir())


@pytest.mark.parametrize(("name", "program"), [("dace", "library"), ("dace-loops", "loops")])
def test_a_dace_program_that_will_not_build_is_refused_naming_what_it_needs(monkeypatch, tmp_path, name, program):
    _needs(name)
    import dace

    from archipelago.island.backends import dace as dace_backend

    def no_compiler(self, *args, **kwargs):
        raise RuntimeError("CMake failed: no CMAKE_CXX_COMPILER could be found\nmore lines")
    monkeypatch.setattr(dace_backend, "_PROGRAMS", {})  # not the ones this process loaded already
    monkeypatch.setattr(dace.SDFG, "compile", no_compiler)
    with pytest.raises(ValueError, match=rf"{program} program did not build in .* \(RuntimeError: CMake failed: no "
                                         r"CMAKE_CXX_COMPILER could be found\); DaCe builds with cmake and a C\+\+"):
        apply_backend(_llama(), name, CPU, FP32, tmp_path)


def test_the_dace_backend_is_dace_lowering_its_matmul_node_to_the_wheels_openblas():
    # What `dace` compiles: DaCe's MatMul library node, expanded by DaCe to a Gemm node and that
    # by the implementation dace_blas.py registers, to one cblas_sgemm call built in the wheel's
    # environment; what `dace-loops` compiles: no library call, no environment.
    _needs("dace")
    from archipelago.island.backends import dace as dace_backend
    from archipelago.island.backends import dace_blas

    def tasklets(program: str) -> list:
        compiled = dace_backend.load(default_cache_dir(), program)
        return [node for node, _ in compiled.sdfg.all_nodes_recursive() if type(node).__name__ == "Tasklet"]

    blas = [t for t in tasklets("library") if "cblas_sgemm" in t.code.as_string]
    assert len(blas) == 1 and blas[0].environments == {dace_blas.WheelOpenBLAS.full_class_path()}
    assert not any("cblas" in t.code.as_string or t.environments for t in tasklets("loops"))
    assert describe_backend("dace").endswith(f"MatMul library node -> OpenBLAS {dace_blas.version()}")
    assert describe_backend("dace-loops").endswith("generated loops")


def test_islands_declare_their_compute_and_unlike_ones_still_match():
    cfg = load_config([*TINY, "--fault_tolerance.enable"])
    shapes = [("w", (4, 4))]
    mine = fingerprint("llama3/debug", shapes, cfg.fault_tolerance, 2, compute="cpu float32, eager (torch 2.13)")
    theirs = fingerprint("llama3/debug", shapes, cfg.fault_tolerance, 1, compute="cpu float32, dace 1.0.2 (cpu)")
    assert mismatch(mine, theirs) is None  # declared, not compared
    table = [mine, {**theirs, "island": 1}, {"island": 2, "compute": "x\x1b[2J" + "y" * 200}]
    line = members_compute(table)
    assert line.startswith("island 0: cpu float32, eager (torch 2.13); island 1: cpu float32, dace 1.0.2 (cpu)")
    assert line.endswith("island 2: x[2J" + "y" * 76)  # a peer's text: printable only, cut to 80 characters
    assert describe_backend("eager").startswith("eager (torch ")


def test_the_doctor_says_whether_the_backend_runs_here(monkeypatch):
    from archipelago.island.backends import dace
    from archipelago.launch import doctor_checks

    eager = doctor_checks.check_backend(load_config(TINY))
    assert (eager.status, eager.detail) == ("ok", f"training.backend = eager: {describe_backend('eager')}")
    cfg = load_config([*TINY, "--training.backend", "dace"])
    monkeypatch.setattr(dace, "available", lambda: "no dace here: pip install --no-deps -r requirements-dace.txt")
    missing = doctor_checks.check_backend(cfg)
    assert missing.status == "FAIL" and "requirements-dace.txt" in missing.fix


@pytest.mark.slow  # about a minute on 2 cores: make test-slow
@pytest.mark.timeout(420)
def test_a_dace_island_and_an_eager_island_train_heal_and_agree(tmp_path):
    # One federation, island 1 computing through DaCe, island 0 SIGKILLed mid-run and
    # restarted from its checkpoint; island 0 heals from the DaCe island, and both end on the
    # same global weights. The kill lands at island 0's step 16 (its metrics, written every
    # step), after the round at step 15 and past its last checkpoint (step 10), so it comes
    # back a round behind and must heal whenever it rejoins; a kill at a fixed second missed that
    # on a loaded machine (island 0 still starting at 15 s). Island 1 is slowed 25x
    # (island.slowdown, 0.8-2.5 s a step) so that its 24 steps after the kill outlast island
    # 0's restart (7-15 s): through OpenBLAS it would otherwise finish alone first.
    _needs("dace")
    run = tmp_path / "run"
    done = run_cli(["local", "--islands", "1,1", "--no-table", *TINY, "--model.flavor", "tiny",
                    "--training.batch_size", "4", "--training.steps", "40", "--fault_tolerance.sync_steps", "5",
                    "--training.val_every", "0", "--checkpoint.interval", "10", "--metrics.log_every", "1",
                    "--island-options",
                    "1:--training.backend dace --training.mixed_precision fp32 --island.slowdown 25",
                    "--kill", "0@step16", "--restart-after", "1", "--job.run_dir", str(run)], timeout=400)
    assert done.returncode == 0, done.output[-4000:]
    fed = json.loads((run / "federation.json").read_text())
    assert [i["restarts"] for i in fed["islands"]] == [1, 0], fed["islands"]
    assert all(i["final_step"] == 40 for i in fed["islands"]), fed["islands"]
    healed = [r for r in fed["outer_steps"] if 0 in r["healed"] and r["outer_step"] > 1]
    assert healed and healed[0]["islands"] == [0, 1], fed["outer_steps"]  # from the DaCe island, mid-run
    # Both islands committed rounds after the heal with equal global hashes. One island may end
    # with a round of its own (on CI's loaded machine one did: the last shared round agreed and
    # the final hashes differed), so at most one lone round may follow the last shared one.
    shared = fed["global_hash_outer_step"]
    assert fed["global_hash_agree"] and shared > healed[0]["outer_step"], fed["outer_steps"]
    after = [r for r in fed["outer_steps"] if r["outer_step"] > shared]
    assert len(after) <= 1 and all(len(r["islands"]) == 1 for r in after), fed["outer_steps"]
    log1 = (run / "island-1" / "train.log").read_text()
    assert "module(s) compute through it" in log1
    assert "island 1: cpu float32, dace 1.0.2" in (run / "island-0" / "train.log").read_text()

"""Trainer overhead: Archipelago's trainer vs a minimal hand-written PyTorch loop.

Both run the same model, batch, sequence length, optimizer and thread count in this
one process; each is timed over the same number of steady-state steps after a warm-up,
and the two alternate for several repeats so drift in machine speed hits both. Prints
a table (ratio first; model FLOPs utilisation beside tokens/s) and writes JSON with --out.

    python bench/throughput.py [--model llama3] [--flavor debug] [--steps 30] [--repeats 3] [--out FILE]
    python bench/throughput.py --device cuda --flavor small --batch-size 16   # on a GPU
    python bench/throughput.py --device cuda --flavor 1B --seq-len 2048 --batch-size 4 --compile   # MFU, 1B class
    python bench/throughput.py --model gpt_oss                               # + the experts' kernels

With `--model gpt_oss` a second table compares the dropless batched experts (one batched
matmul per projection over all experts) with a Python loop over experts on the same
routed tokens, forward and backward, in the same run.

With `--backend dace` (or `dace-loops`) the comparison is the trainer with that
`training.backend` against the same trainer with `eager` (ratio over eager, both fp32 on the
CPU, alternating), and a second table times the model's distinct linear-layer products
(forward shapes: tokens x in -> out) as torch.mm, as the two backends' DaCe programs (the
MatMul library node expanded to OpenBLAS; DaCe's generated loops), and as DaCe's other
lowerings of the same product (the `dace` backend's MatMul library node left to DaCe's own
loops, `pure`; the same after DaCe's `auto_optimize` (tiling, fusion, parallel maps); one
dot product per element, bench/dace_variants.py), each compiled once before timing:

    python bench/throughput.py --backend dace --flavor debug --steps 3 --warmup 1 --repeats 2

On CUDA both loops compute in bf16 (the trainer's `mixed_precision = "auto"`), the
minimal one under `torch.autocast`; timing ends with a device synchronize.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import where_measured, write_json  # noqa: E402

from archipelago.config import Config, validate  # noqa: E402
from archipelago.data import TokenSequenceLoader, prepare_from_config  # noqa: E402
from archipelago.island.parallelize import wrap_blocks  # noqa: E402
from archipelago.metrics.throughput import peak_flops_per_s  # noqa: E402
from archipelago.models import build_model, get_model_args  # noqa: E402
from archipelago.trainer import StepResult, Trainer  # noqa: E402


def bench_config(args: argparse.Namespace, run_dir: Path) -> Config:
    cfg = Config()
    cfg.model.name = args.model
    cfg.model.flavor = args.flavor
    cfg.data.seq_len = args.seq_len
    cfg.training.batch_size = args.batch_size
    cfg.training.steps = args.warmup + args.steps
    cfg.training.val_every = 0
    cfg.lr_scheduler.warmup_steps = 0
    cfg.checkpoint.enable = cfg.checkpoint.resume = False
    cfg.metrics.progress = "off"
    cfg.metrics.tensorboard = False
    cfg.metrics.log_every = args.steps  # one log line in the timed window, as a real run would
    cfg.job.run_dir = str(run_dir)
    cfg.training.device = args.device
    cfg.training.compile = args.compile
    cfg.training.activation_checkpointing = args.activation_checkpointing
    return validate(cfg)


class TimedTrainer(Trainer):
    """The real trainer; only `after_step` is extended to stamp the timed window."""

    warmup = 0
    t0 = t1 = 0.0

    def after_step(self, result: StepResult, **kwargs) -> None:
        super().after_step(result, **kwargs)
        if self.progress.step == self.warmup:
            _sync(self.cfg.training.device)  # a CPU-GPU sync point, outside the timed window
            self.t0 = time.perf_counter()
        _sync(self.cfg.training.device)
        self.t1 = time.perf_counter()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_trainer(cfg: Config, warmup: int) -> float:
    trainer = TimedTrainer(cfg)
    trainer.warmup = warmup
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer.t1 - trainer.t0


def dace_config(cfg: Config, backend: str) -> Config:
    """The same run computing through a DaCe backend (fp32 on the CPU)."""
    other = copy.deepcopy(cfg)
    other.training.backend = backend
    other.training.mixed_precision = "fp32"
    return validate(other)


def product_shapes(args: argparse.Namespace, vocab: int) -> list[tuple[int, int, int]]:
    """(tokens, in, out) of each distinct nn.Linear of the model, in order of first use."""
    model = build_model(get_model_args(args.model, args.flavor, vocab_size=vocab), device="meta")
    tokens = args.batch_size * args.seq_len
    shapes = [(tokens, m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return list(dict.fromkeys(shapes))


def dace_variants(cache: Path) -> dict[str, Any]:
    """The DaCe programs to time, compiled (cached in `cache`): the backends' and DaCe's other lowerings."""
    import warnings

    import dace
    import dace_variants as variants
    from dace.config import Config as DaceConfig
    from dace.transformation.auto.auto_optimize import auto_optimize

    from archipelago.island.backends import dace as backend
    from archipelago.island.backends import dace_program

    built = {"dace (library node -> OpenBLAS)": backend.load(cache, backend.LIBRARY),
             "dace-loops": backend.load(cache, backend.LOOPS)}
    DaceConfig.set("default_build_folder", value=str(cache / "dace-bench"))
    DaceConfig.set("compiler", "use_cache", value=False)  # built afresh each run: nothing stale is timed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, program, optimize in (("library node, pure", dace_program.matmul_library, False),
                                        ("library node + auto_optimize", dace_program.matmul_library, True),
                                        ("dot per element", variants.dot_products, False)):
            sdfg = copy.deepcopy(program.to_sdfg(simplify=True))  # the parser may hand out one SDFG twice
            sdfg.name = f"bench_{program.name}_{int(optimize)}"
            if optimize:
                auto_optimize(sdfg, dace.DeviceType.CPU)
            built[name] = sdfg.compile()
    return built


def bench_dace_kernels(args: argparse.Namespace, vocab: int, cache: Path) -> list[dict[str, Any]]:
    """Seconds per call of each product of the model, torch.mm against the DaCe programs
    (best of `repeats` calls after one warm-up call, whose result is checked)."""
    programs = dace_variants(cache)
    rows = []
    for n, k, m in product_shapes(args, vocab):
        a, b = torch.randn(n, k), torch.randn(k, m)
        bt = b.t().contiguous()  # the dot products read b transposed
        row: dict[str, Any] = {"shape": [n, k, m]}
        for name in ["torch.mm", *programs]:
            second = bt if name == "dot per element" else b
            row[name] = time_product(programs.get(name), a, second, a @ b, args.repeats)
        rows.append(row)
    return rows


def time_product(program: Any, a: torch.Tensor, b: torch.Tensor, expected: torch.Tensor, repeats: int) -> float:
    """Best seconds per call of `program` (None: torch.mm) on a [N, K] and b, after a
    warm-up call checked against `expected`."""
    (n, k), m = a.shape, expected.shape[1]
    c = torch.empty(n, m)
    best = float("inf")
    for call in range(repeats + 1):
        t0 = time.perf_counter()
        if program is None:
            torch.mm(a, b, out=c)
        else:
            arrays = dict(zip(program.sdfg.arg_names, (a.numpy(), b.numpy(), c.numpy()), strict=True))
            program(**arrays, N=n, K=k, M=m)
        seconds = time.perf_counter() - t0
        if call == 0:
            err = float((c - expected).abs().max() / expected.abs().max())
            assert err < 1e-4, f"{n}x{k}x{m}: relative error {err:.1e}"
        else:
            best = min(best, seconds)
    return best


def print_dace_kernels(rows: list[dict[str, Any]], threads: int, backend: str) -> None:
    names = [k for k in rows[0] if k not in ("shape", "torch.mm")]
    chosen = next(name for name in names if name.split(" ")[0] == backend)
    print(f"\nthe model's products a[tokens, in] @ b[in, out], fp32, {threads} threads: ms per call (best of the "
          "repeats), each DaCe program's time over torch.mm's in brackets\n")
    print(f"| {backend} / torch.mm | tokens x in -> out | torch.mm ms | " + " | ".join(names) + " |")
    print("|---:|---|---:|" + "---:|" * len(names))
    for r in rows:
        n, k, m = r["shape"]
        cells = " | ".join(f"{1e3 * r[name]:.1f} ({r[name] / r['torch.mm']:.0f}x)" for name in names)
        print(f"| {r[chosen] / r['torch.mm']:.2f} | {n} x {k} -> {m} | {1e3 * r['torch.mm']:.2f} | {cells} |")


def model_flops(args: argparse.Namespace, vocab: int) -> tuple[float, float, str]:
    """Training FLOPs per token of the model (the trainer's MFU formula) and the device's
    peak FLOP/s for its compute dtype (bf16 on a GPU: the datasheet's dense figure; on a
    CPU a measured matmul peak), with where the peak came from."""
    flops = get_model_args(args.model, args.flavor, vocab_size=vocab).flops_per_token(args.seq_len)
    device = torch.device(args.device)
    peak, source = peak_flops_per_s(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    return float(flops), peak, source


def run_minimal(cfg: Config, dataset_train: Path, vocab: int, dtype: str, warmup: int, steps: int) -> float:
    """The baseline: what one would write by hand, batches already in memory."""
    args = get_model_args(cfg.model.name, cfg.model.flavor, vocab_size=vocab)
    torch.manual_seed(cfg.training.seed)
    device = torch.device(cfg.training.device)
    model = build_model(args, device="cpu").to(device)
    wrap_blocks(model, activation_checkpointing=cfg.training.activation_checkpointing,  # as the island wraps them
                compile_blocks=cfg.training.compile)
    bf16 = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr, betas=(0.9, 0.95),
                            weight_decay=0.1, foreach=True)
    loader = TokenSequenceLoader(dataset_train, cfg.data.seq_len, cfg.training.batch_size, 0, 1,
                                 seed=0, dtype=dtype)
    batches = [tuple(t.to(device) for t in loader.next_batch()) for _ in range(warmup + steps)]
    t0 = 0.0
    for i, (x, y) in enumerate(batches):
        if i == warmup:
            _sync(cfg.training.device)
            t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        if hasattr(model, "expert_load"):  # a mixture of experts: its balancing loss, as the trainer adds it
            loss = loss + cfg.model.aux_loss_coef * model.aux_loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
    loss.item()
    return time.perf_counter() - t0


def bench_experts(args: argparse.Namespace, vocab: int) -> dict:
    """Batched dropless experts vs a loop over experts: forward + backward of one layer's
    experts on the tokens of one batch, routed by that layer's router."""
    model_args = get_model_args("gpt_oss", args.flavor, vocab_size=vocab)
    device = torch.device(args.device)
    experts = build_model(model_args, device="cpu").layers[0].moe.to(device)
    x = torch.randn(args.batch_size * args.seq_len, model_args.dim, device=device)
    top, chosen = experts.router(x).topk(model_args.top_k, dim=-1)
    weights = torch.softmax(top, dim=-1).detach()

    def timed(fn) -> float:  # noqa: ANN001
        best = float("inf")
        for _ in range(args.repeats):
            for k in range(args.warmup + args.steps):
                if k == args.warmup:
                    _sync(args.device)
                    t0 = time.perf_counter()
                fn(x, chosen, weights).sum().backward()
            _sync(args.device)
            best = min(best, (time.perf_counter() - t0) / args.steps)
        return best

    batched, loop = timed(experts.experts.forward), timed(experts.experts.forward_loop)
    return {"ratio": loop / batched, "batched_s": batched, "loop_s": loop, "tokens": x.shape[0],
            "experts": model_args.n_experts, "top_k": model_args.top_k}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3", choices=["llama3", "qwen3", "gpt_oss"])
    p.add_argument("--flavor", default="debug")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=30, help="timed steps per repeat")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--device", default="cpu", help="cpu or cuda (bf16 compute on cuda)")
    p.add_argument("--compile", action="store_true", help="torch.compile each block, in both loops")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's activations in the backward, in both loops (larger models)")
    p.add_argument("--backend", choices=["eager", "dace", "dace-loops"], default="eager",
                   help="dace or dace-loops: the trainer through that training.backend against the trainer with "
                        "eager (instead of the minimal loop), and the DaCe kernel table (CPU only)")
    p.add_argument("--no-kernel-table", action="store_true",
                   help="--backend dace(-loops): leave out the kernel table (DaCe's library node takes minutes per "
                        "product of the small flavor)")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args()
    if args.backend != "eager" and (args.device != "cpu" or args.compile or args.model == "gpt_oss"):
        p.error(f"--backend {args.backend}: CPU only, without --compile, for llama3 or qwen3")
    torch.set_num_threads(args.threads)

    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="archipelago-bench-"))
    cfg = bench_config(args, tmp / "run")
    ds = prepare_from_config(cfg.data, cfg.training.seed, log=lambda _m: None)
    tokens = args.steps * args.batch_size * args.seq_len
    if args.backend != "eager":
        main_dace(args, cfg, tmp, ds.vocab_size, tokens)
        return
    trainer_tps, minimal_tps = [], []
    for r in range(args.repeats):
        cfg.job.run_dir = str(tmp / f"run{r}")
        trainer_tps.append(tokens / run_trainer(cfg, args.warmup))
        minimal_tps.append(tokens / run_minimal(cfg, ds.train_path, ds.vocab_size, ds.dtype,
                                                args.warmup, args.steps))
    trainer_med, minimal_med = statistics.median(trainer_tps), statistics.median(minimal_tps)
    ratio = trainer_med / minimal_med
    flops_per_token, peak, peak_source = model_flops(args, ds.vocab_size)
    result = {
        "model": args.model, "ratio": ratio, "trainer_tokens_per_s": trainer_med, "minimal_tokens_per_s": minimal_med,
        "trainer_runs": trainer_tps, "minimal_runs": minimal_tps, "flavor": args.flavor,
        "seq_len": args.seq_len, "batch_size": args.batch_size, "steps": args.steps,
        "repeats": args.repeats, "compile": args.compile,
        "activation_checkpointing": args.activation_checkpointing, "threads": args.threads,
        **where_measured(device=args.device),
        "flops_per_token": flops_per_token, "peak_flops_per_s": peak, "peak_source": peak_source,
        "trainer_mfu": trainer_med * flops_per_token / peak, "minimal_mfu": minimal_med * flops_per_token / peak,
    }
    print(f"\n{args.model}/{args.flavor} on {args.device}, batch {args.batch_size} x seq {args.seq_len}, "
          f"{args.threads} threads, {args.steps} timed steps x {args.repeats} repeats (median)\n")
    print("| ratio (trainer / minimal) | trainer tokens/s | minimal loop tokens/s | trainer MFU | minimal MFU |")
    print("|---:|---:|---:|---:|---:|")
    print(f"| {ratio:.3f} | {trainer_med:,.0f} | {minimal_med:,.0f} | {100 * result['trainer_mfu']:.1f}% "
          f"| {100 * result['minimal_mfu']:.1f}% |")
    print(f"\nMFU: {flops_per_token:.3g} training FLOPs per token (6 x the matmul parameters + attention) over "
          f"a peak of {peak / 1e12:.1f} TFLOP/s ({peak_source})")
    if args.model == "gpt_oss":
        kernels = result["experts_kernel"] = bench_experts(args, ds.vocab_size)
        print(f"\nexperts of one layer, {kernels['tokens']} tokens, {kernels['experts']} experts, "
              f"top-{kernels['top_k']}, forward + backward (best of the repeats)\n")
        print("| ratio (loop / batched: speed-up) | batched ms | loop over experts ms |")
        print("|---:|---:|---:|")
        print(f"| {kernels['ratio']:.2f} | {1e3 * kernels['batched_s']:.2f} | {1e3 * kernels['loop_s']:.2f} |")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.out}")


def main_dace(args: argparse.Namespace, cfg: Config, tmp: Path, vocab: int, tokens: int) -> None:
    """--backend dace(-loops): the trainer through DaCe against the trainer with eager,
    alternating, then the kernel table."""
    from archipelago.data import default_cache_dir

    dace_cfg = dace_config(cfg, args.backend)
    dace_tps, eager_tps = [], []
    for r in range(args.repeats):
        dace_cfg.job.run_dir, cfg.job.run_dir = str(tmp / f"dace{r}"), str(tmp / f"eager{r}")
        dace_tps.append(tokens / run_trainer(dace_cfg, args.warmup))
        eager_tps.append(tokens / run_trainer(cfg, args.warmup))
    dace_med, eager_med = statistics.median(dace_tps), statistics.median(eager_tps)
    flops_per_token, peak, peak_source = model_flops(args, vocab)
    kernels = [] if args.no_kernel_table else bench_dace_kernels(args, vocab, default_cache_dir())
    result = {"model": args.model, "flavor": args.flavor, "backend": args.backend, "ratio": dace_med / eager_med,
              "dace_tokens_per_s": dace_med, "eager_tokens_per_s": eager_med, "dace_runs": dace_tps,
              "eager_runs": eager_tps, "seq_len": args.seq_len, "batch_size": args.batch_size, "steps": args.steps,
              "warmup": args.warmup, "repeats": args.repeats, "threads": args.threads, **where_measured(),
              "flops_per_token": flops_per_token, "peak_flops_per_s": peak, "peak_source": peak_source,
              "dace_mfu": dace_med * flops_per_token / peak, "eager_mfu": eager_med * flops_per_token / peak,
              "kernels": kernels}
    print(f"\n{args.model}/{args.flavor} on the CPU, fp32, batch {args.batch_size} x seq {args.seq_len}, "
          f"{args.threads} threads, {args.steps} timed steps x {args.repeats} repeats (median), the trainer both\n")
    print(f"| ratio ({args.backend} / eager tokens/s) | {args.backend} tokens/s | eager tokens/s | "
          f"{args.backend} MFU | eager MFU |")
    print("|---:|---:|---:|---:|---:|")
    print(f"| {result['ratio']:.3f} | {dace_med:,.1f} | {eager_med:,.1f} | {100 * result['dace_mfu']:.2f}% "
          f"| {100 * result['eager_mfu']:.2f}% |")
    if kernels:
        print_dace_kernels(kernels, args.threads, args.backend)
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()

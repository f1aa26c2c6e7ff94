"""`archipelago`: one console script, one subcommand per job.

Each subcommand is a small function taking the remaining argv (`lighthouse` lives in
launch/lighthouse.py, `local` in launch/local.py); the config-driven ones (`train`, `data prepare`, `config show`)
share one parser (config/loading.py), so the same TOML file and `--section.key`
overrides work everywhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from archipelago.config import Config, ConfigError, config_to_dict, load_config, validate_for_island
from archipelago.island.batches import check_rank_slowdown, rank_batches
from archipelago.launch.args import pop_option
from archipelago.launch.processes import rank_threads
from archipelago.netutil import bound_tcp_store, local_address, url_host

USAGE = """\
usage: archipelago COMMAND [ARGS]

Train one model across heterogeneous compute islands.

commands:
  train          train on this island (--config FILE, --nproc N, --section.key VALUE ...)
  lighthouse     run the lighthouse that islands join (--bind HOST:PORT, --min-replicas N,
                 --key-file FILE: members only)
  local          a whole federation on this machine: a lighthouse and one torchrun per
                 island (--islands 2,1, --kill ISLAND@SECONDS, --restart-after SECONDS)
  data prepare   fetch the corpus, train the tokenizer, write token files (cached); or fetch images
  models         list every model family and flavor with its parameter count
  plan           measure each rank of this island and split the batch to their speeds
                 (--config FILE, --nproc N, --out FILE)
  report RUN_DIR write a loss plot and a Markdown summary of a run (or a federation);
                 --baseline RUN_DIR puts another run's final val loss beside it
  export RUN_DIR OUT --format hf
                 write the run's newest checkpoint as a Hugging Face model directory
  generate SOURCE --prompt TEXT
                 text from a run directory or a Hugging Face directory (KV cache;
                 --greedy, or --temperature T --top-p P; --max-new-tokens N)
  config         `config reference` prints the configuration reference;
                 `config show [--config FILE] [overrides]` prints the resolved config;
                 `config convert FILE` prints a torchtitan-format run file as ours
  secret new     make a new federation secret (`archipelago secret new --out fed.key`: mode 600)
  simulate SCENARIO
                 a federation of 10 to 1,000 islands on a simulated clock: utilisation,
                 goodput, bytes, failures (--islands N ..., --hours H)
  doctor         check, in seconds, why this island cannot reach the others: lighthouse,
                 LOCAL_ADDR, interfaces, ports, peers (latency, bandwidth, versions,
                 config fingerprint, clocks), devices, disk; a fix per failing line

Run `archipelago COMMAND --help` for the options of one command.
"""

TRAIN_HELP = """\
Train on one island. Options: --config FILE (a TOML run file; $CONFIG_FILE also works),
--nproc N (start N local ranks under torchrun; $NGPU means the same), and any
--section.key VALUE below. Under torchrun (multi-node) call `archipelago train` as the
torchrun program instead of using --nproc.
"""

log = logging.getLogger("archipelago")


def setup_logging(level: str = "info", rank: int = 0) -> None:
    """Plain log lines on stderr; only rank 0 speaks below WARNING."""
    prefix = f"[rank {rank}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    logging.basicConfig(format=f"%(asctime)s {prefix}%(levelname)s %(message)s", datefmt="%H:%M:%S",
                        level=getattr(logging, level.upper()) if rank == 0 else logging.WARNING,
                        force=True)


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def _check_model(cfg: Config) -> None:
    """Fail before any process starts when the model name, flavor or dataset is wrong."""
    from archipelago.tasks import check_model

    check_model(cfg)


FAILURE_FILE = "failure.json"


def _known_failure(exc: BaseException) -> tuple[int, str] | None:
    """(exit code, message) for errors whose message already names the fix; else None."""
    from archipelago.checkpoint import CheckpointUnusable
    from archipelago.data import CorpusUnavailable, ImagesUnavailable, TokenRangeError
    from archipelago.federation import FederationError
    from archipelago.trainer import NonFiniteLossError

    if isinstance(exc, NonFiniteLossError):
        return 3, str(exc)
    if isinstance(exc, FederationError):
        return 4, f"error: {exc}"
    if isinstance(exc, (ConfigError, CheckpointUnusable, TokenRangeError)):
        return 2, f"error: {exc}"
    if isinstance(exc, (CorpusUnavailable, ImagesUnavailable)):
        return 1, f"error: {exc}"
    if isinstance(exc, KeyboardInterrupt):
        return 130, "interrupted"
    return None


def _failure(exc: BaseException) -> tuple[int, str]:
    """(exit code, message) for any exception that ended training on this rank."""
    return _known_failure(exc) or (1, f"{type(exc).__name__}: {exc} (traceback above)")


def _record_failure(cfg: Config, code: int, message: str) -> None:
    """Leave the reason in RUN_DIR so the launcher can repeat it after torchrun's report.

    The first rank to fail holds the cause; ranks failing after it (their peer went
    away mid-collective) only report the symptom, so an existing record is kept.
    """
    if not cfg.job.run_dir:
        return
    record = {"exit_code": code, "message": message, "rank": os.environ.get("RANK", "0")}
    try:
        with open(Path(cfg.job.run_dir) / FAILURE_FILE, "x") as f:  # "x": only the first writer
            json.dump(record, f)
    except OSError:  # FileExistsError: a rank failed first; a missing run_dir: nothing to keep
        pass


def _spawn_torchrun(nproc: int, argv: list[str], cfg: Config, command: str = "train") -> int:
    """Run this command as `nproc` local ranks under torchrun's elastic agent; returns the
    island's exit code.

    The agent runs in this process (what `torchrun --standalone` would run in a process of
    its own): one interpreter and one torch import fewer per launch, and the failure file
    is read by the process that started the ranks.
    """
    run_dir = cfg.job.run_dir or f"runs/{cfg.job.name}-{datetime.now():%Y%m%d-%H%M%S}"
    # Prepare once here, with progress on the terminal, so the ranks find it cached.
    from archipelago.tasks import build_task

    build_task(cfg).prepare(log.info)
    (Path(run_dir) / FAILURE_FILE).unlink(missing_ok=True)
    # torchrun would set 1 with a warning; say it ourselves: cores / ranks threads each.
    # The ranks inherit this process's environment.
    os.environ["OMP_NUM_THREADS"] = rank_threads(nproc)
    log.info("starting %d ranks under torchrun%s", nproc, f"; run directory {run_dir}" if command == "train" else "")
    code = _run_elastic_agent([*_rendezvous_args(), f"--nproc-per-node={nproc}", "-m", "archipelago.launch.cli",
                               command, *argv, f"--job.run_dir={run_dir}"])
    if code != 0:
        failure = Path(run_dir) / FAILURE_FILE
        if failure.is_file():  # the failing rank's own reason and exit code, not torchrun's
            record = json.loads(failure.read_text())
            print(f"\nrank {record['rank']} failed: {record['message']}", file=sys.stderr)
            code = int(record["exit_code"])
        log.error("the island failed (exit code %d); it resumes from its last checkpoint when "
                  "restarted with --job.run_dir %s", code, run_dir)
    return code


def _rendezvous_args() -> list[str]:
    """torchrun's rendezvous options for one node on LOCAL_ADDR or loopback (`_bound_stores`
    makes its stores listen there)."""
    host = local_address()
    return ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={url_host(host)}:0",
            f"--local-addr={host}", f"--rdzv-id={uuid.uuid4().hex}"]


@contextlib.contextmanager
def _bound_stores() -> Iterator[None]:
    """While torchrun's agent runs here, its two TCPStore servers (the rendezvous store,
    and the one it shares with the ranks as MASTER_ADDR:MASTER_PORT) listen on the host
    they are given instead of every interface (netutil.bound_tcp_store)."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous

    original_rendezvous = c10d_rendezvous_backend.TCPStore
    original_shared = dynamic_rendezvous.DynamicRendezvousHandler._create_tcp_store_server

    def rendezvous_store(host_name: str, port: int, is_master: bool = False, **kwargs: Any) -> Any:
        if is_master and port == 0:
            return bound_tcp_store(host_name)
        return original_rendezvous(host_name, port, is_master=is_master, **kwargs)

    def shared_store(self: Any, master_addr: str, master_port: int) -> Any:
        return bound_tcp_store(master_addr) if master_port == 0 else original_shared(self, master_addr, master_port)

    c10d_rendezvous_backend.TCPStore = rendezvous_store  # type: ignore[misc,assignment]
    dynamic_rendezvous.DynamicRendezvousHandler._create_tcp_store_server = shared_store  # type: ignore[method-assign]
    try:
        yield
    finally:
        c10d_rendezvous_backend.TCPStore = original_rendezvous  # type: ignore[misc]
        dynamic_rendezvous.DynamicRendezvousHandler._create_tcp_store_server = original_shared  # type: ignore[method-assign]


def _run_elastic_agent(torchrun_args: list[str]) -> int:
    """`torchrun TORCHRUN_ARGS` inside this process; 0, 1 when a rank failed, or 128 + the
    signal that stopped the agent (it stops the ranks first, as torchrun does)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        with _bound_stores():
            run(parse_args(torchrun_args))
    except ChildFailedError as exc:  # torchrun's own exit code for it: 1
        rank, failure = exc.get_first_failure()
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        log.error("rank %s stopped first, with %s", rank, how)
        return 1
    except SignalException as exc:
        return 128 + int(exc.sigval)
    except KeyboardInterrupt:
        return 130
    return 0


def cmd_train(argv: list[str]) -> int:
    nproc_arg, argv = pop_option(argv, "--nproc")
    nproc_text = nproc_arg or os.environ.get("NGPU") or "1"
    if not nproc_text.isdigit() or int(nproc_text) < 1:
        raise ConfigError(f"--nproc / NGPU = {nproc_text!r}: expected a positive whole number of ranks")
    nproc = int(nproc_text)
    rank = int(os.environ.get("RANK", "0"))
    cfg = load_config(argv, prog="archipelago train", description=TRAIN_HELP)
    setup_logging(cfg.job.log_level, rank)
    _check_model(cfg)
    ranks = int(os.environ.get("WORLD_SIZE", nproc))
    validate_for_island(cfg, ranks)
    # per-rank micro-batches add up, before any process starts (a pipeline's stages share each batch)
    rank_batches(cfg, 1 if cfg.parallelism.pipeline_stages > 1 else ranks)
    check_rank_slowdown(cfg, ranks)
    if nproc > 1 and not _under_torchrun():
        return _spawn_torchrun(nproc, argv, cfg)
    return _train_here(cfg, rank)


PLAN_HELP = """\
Measure each rank of this island (forward and backward time per sample and per layer, memory;
per sample at several micro-batch sizes) and print how to split the batch over them, by a
model of how the ranks meet (FSDP: in the first forward and the last backward of each step;
DDP: at its end): each rank's micro-batch size and count, its
predicted time and idle fraction, and the predicted step time. Options: --config FILE,
--nproc N, --out FILE (where to write the TOML fragment; default plan.toml), and the
--section.key VALUE options of `archipelago train` (e.g. --island.rank_slowdown 1,2 to
emulate a slow rank). Train with the plan by adding the options it prints to `archipelago
train`, or by pasting the fragment into FILE; or let `--parallelism.auto` plan at start.

--from-run RUN_DIR re-plans from what a training run measured instead, without profiling:
the split it ran comes from RUN_DIR/config.json (from the options given where the folder
has none), and each rank's speed from the run's step records (its idle share of a step and
the step time, metrics.jsonl; written by CPU islands of two or more ranks). A profile times
each rank alone before training; in the run the ranks share the machine, which the re-plan
corrects for.
"""


def cmd_plan(argv: list[str]) -> int:
    nproc_arg, argv = pop_option(argv, "--nproc")
    out_arg, argv = pop_option(argv, "--out")
    from_run, argv = pop_option(argv, "--from-run")
    nproc = int(nproc_arg or os.environ.get("NGPU") or "1")
    cfg = load_config(argv, prog="archipelago plan", description=PLAN_HELP)
    setup_logging(cfg.job.log_level, int(os.environ.get("RANK", "0")))
    if from_run:
        from archipelago.launch.plan import replan_here

        return replan_here(cfg, from_run, out_arg or "plan.toml")
    _check_model(cfg)
    if nproc > 1 and not _under_torchrun():
        return _spawn_torchrun(nproc, [*argv, "--out", out_arg or "plan.toml"], cfg, "plan")
    from archipelago.launch.plan import plan_here

    return plan_here(cfg, out_arg or "plan.toml")


def _train_here(cfg: Config, rank: int) -> int:
    """Train as this process (one rank of the island); returns the exit code."""
    from archipelago.trainer import run_training

    try:
        summary = run_training(cfg)
    except BaseException as exc:  # noqa: BLE001 - every failure gets a code and a message
        code, message = _failure(exc)
        if code == 1 and not isinstance(exc, KeyboardInterrupt):
            log.exception("training failed")
        log.error("%s", message)
        _record_failure(cfg, code, message)
        if _without_teardown():
            # Skip interpreter teardown: other ranks may be stuck in a collective, and
            # destroying process groups then can hang; torchrun (or `archipelago local`)
            # stops them for us.
            _exit_now(code)
        return code
    if rank == 0:
        print(json.dumps(summary, indent=2))
    if _without_teardown():
        _exit_now(0)
    return 0


def _without_teardown() -> bool:
    """Whether this process leaves through `_exit_now`: a rank under torchrun, or a one-rank
    island that `archipelago local` started (its island token in the environment). Not a
    `train` run inside another program's process (tests call `main`), which must return."""
    from archipelago.launch.local import TOKEN_ENV

    return _under_torchrun() or bool(os.environ.get(TOKEN_ENV))


def _exit_now(code: int) -> None:
    """Flush and leave without interpreter teardown (`_without_teardown`).

    gloo's worker threads can still be freeing a finished collective's tensors while
    Python shuts down, which aborts the process ("terminate called without an active
    exception", exit code 134 instead of the run's own) in a fraction of runs. Everything
    is written and the process group is closed by now, so there is nothing left for
    teardown to do.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_data(argv: list[str]) -> int:
    if not argv or argv[0] != "prepare":
        print("usage: archipelago data prepare [--config FILE] [--data.key VALUE ...]", file=sys.stderr)
        return 2
    cfg = load_config(argv[1:], prog="archipelago data prepare",
                      description="Fetch the corpus, train the tokenizer and write token files (cached); "
                                  "with --data.dataset fashion_mnist, fetch the images.")
    setup_logging(cfg.job.log_level)
    from archipelago.data import prepare_from_config, prepare_images_from_config

    if cfg.data.dataset == "fashion_mnist":
        folder = prepare_images_from_config(cfg.data, log=print)
        print(f"dataset: {folder}\n  Fashion-MNIST: 60,000 training and 10,000 test images, 28x28, 10 classes")
        return 0
    ds = prepare_from_config(cfg.data, cfg.training.seed, log=print)
    print(f"dataset: {ds.folder}\n  tokenizer: {ds.tokenizer_path} (vocab {ds.vocab_size})\n"
          f"  train: {ds.train_tokens:,} tokens\n  val:   {ds.val_tokens:,} tokens")
    return 0


SECRET_HELP = """\
usage: archipelago secret new --out FILE [--force]
       archipelago secret new

Make a new federation secret (32 random bytes, in hex). With --out FILE it is written to a
new FILE, readable by you only (mode 600 from its creation); an existing FILE is refused
(every island holding the old secret would be locked out) unless --force replaces it.
Without --out it is printed (mind who can read where it goes: islands refuse a key file
that other users can read, naming `chmod 600`).

Copy the file to every island of the federation and to the lighthouse, keeping it mode
600, and point each at it with [federation_security] key_file, --key-file (the
lighthouse) or $ARCHIPELAGO_FEDERATION_KEY_FILE: islands then prove to each other and to
the lighthouse that they hold it before they exchange model state.
"""


def cmd_secret(argv: list[str]) -> int:
    if argv[:1] != ["new"]:
        asked = bool(argv) and argv[0] in ("-h", "--help")
        print(SECRET_HELP, file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    import argparse

    parser = argparse.ArgumentParser(prog="archipelago secret new", usage=SECRET_HELP.splitlines()[0][7:],
                                     add_help=False)
    parser.add_argument("--out", metavar="FILE")
    parser.add_argument("--force", action="store_true")
    parser.add_argument("-h", "--help", action="store_true")
    args = parser.parse_args(argv[1:])
    if args.help:
        print(SECRET_HELP)
        return 0
    if args.force and not args.out:
        parser.error("--force replaces the file --out names; give --out FILE")
    from archipelago.federation.trust import new_secret, write_secret

    if not args.out:
        print(new_secret())
        return 0
    write_secret(args.out, force=args.force)
    print(f"wrote a new federation secret to {args.out} (mode 600): copy it to every island and the lighthouse "
          "(keep it mode 600) and point them at it with [federation_security] key_file, --key-file or "
          "$ARCHIPELAGO_FEDERATION_KEY_FILE")
    return 0


def cmd_models(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print("usage: archipelago models\n\nList every family and flavor with its exact parameter "
              "count (flavors whose vocabulary comes from the tokenizer are counted with the "
              "default vocabulary), language models first, then image models.")
        return 0
    from archipelago.models import DEFAULT_VOCAB_SIZE, list_flavors

    print(f"{'family':<9} {'flavor':<7} {'parameters':>16} {'dim':>6} {'layers':>6} {'heads':>5} "
          f"{'kv':>3} {'vocab':>7} {'FLOPs/token@2k':>16}")
    from_tokenizer = {(f, v) for f, v, a in list_flavors(vocab_size=None) if a.vocab_size is None}
    for family, flavor, args in list_flavors():
        vocab = f"{args.vocab_size}" + ("*" if (family, flavor) in from_tokenizer else "")
        print(f"{family:<9} {flavor:<7} {args.num_params():>16,} {args.dim:>6} {args.n_layers:>6} "
              f"{args.n_heads:>5} {args.n_kv_heads:>3} {vocab:>7} {args.flops_per_token(2048):>16.3e}")
    print(f"\n* vocabulary taken from the tokenizer at train time; counted here with {DEFAULT_VOCAB_SIZE}")
    from archipelago.models.gpt_oss import GptOssArgs
    from archipelago.models.qwen3_moe import Qwen3MoeArgs

    for family, flavor, moe in list_flavors():
        if isinstance(moe, (GptOssArgs, Qwen3MoeArgs)):  # a mixture of experts
            print(f"  {family}/{flavor}: {moe.n_experts} experts, top-{moe.top_k}: "
                  f"{moe.num_active_params():,} parameters active per token (the embedding table left out)")
    _print_image_flavors()
    return 0


def _print_image_flavors() -> None:
    """The image families' table: shapes of inputs and classes, FLOPs per image."""
    from archipelago.models import IMAGE_FAMILIES
    from archipelago.models.resnet import build_resnet

    print(f"\n{'family':<8} {'flavor':<13} {'parameters':>12} {'block':>10} {'layers':>12} {'input':>9} "
          f"{'classes':>7} {'FLOPs/image':>12}")
    for family, flavors in IMAGE_FAMILIES.items():
        for flavor, args in flavors.items():
            model = build_resnet(args, "meta")  # shapes only
            shape = f"{args.in_channels}x{args.image_size}x{args.image_size}"
            layers = "-".join(map(str, args.layers))
            print(f"{family:<8} {flavor:<13} {model.num_params():>12,} {args.block:>10} {layers:>12} {shape:>9} "
                  f"{args.num_classes:>7} {model.flops_per_image():>12.3e}")


def cmd_report(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="archipelago report",
        description="Write RUN_DIR/report/loss.png and RUN_DIR/report/report.md from a run's "
                    "metrics.jsonl and summary.json (or a federation's island-K/ folders), and print "
                    "the report.")
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a run or federation run directory")
    parser.add_argument("--baseline", metavar="RUN_DIR", type=Path, default=None,
                        help="another run (e.g. one island trained alone on the same config) whose "
                             "final validation loss the report puts beside this run's")
    args = parser.parse_args(argv)
    from archipelago.metrics import write_report

    try:
        png, md = write_report(args.run_dir, baseline=args.baseline)
    except ValueError as exc:  # e.g. a baseline that logged no validation loss
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(md.read_text())
    print(f"wrote {png}\nwrote {md}")
    return 0


def cmd_lighthouse(argv: list[str]) -> int:
    from archipelago.launch.lighthouse import cmd_lighthouse as run_lighthouse

    setup_logging()  # the gate names the callers it refuses
    return run_lighthouse(argv)


def cmd_local(argv: list[str]) -> int:
    from archipelago.launch.local import main as run_local

    return run_local(argv)


def cmd_export(argv: list[str]) -> int:
    from archipelago.launch.export import main as run_export

    return run_export(argv)


def cmd_generate(argv: list[str]) -> int:
    from archipelago.launch.generate import main as run_generate

    return run_generate(argv)


def cmd_doctor(argv: list[str]) -> int:
    from archipelago.launch.doctor import main as run_doctor

    return run_doctor(argv)


def cmd_config(argv: list[str]) -> int:
    if argv and argv[0] == "reference":
        from archipelago.config.reference import reference_markdown

        print(reference_markdown())
        return 0
    if argv and argv[0] == "show":
        cfg = load_config(argv[1:], prog="archipelago config show",
                          description="Print the configuration after the TOML file and overrides.")
        print(json.dumps(config_to_dict(cfg), indent=2))
        return 0
    if argv and argv[0] == "convert":
        return convert_config(argv[1:])
    print("usage: archipelago config reference | config show [--config FILE] [overrides] | config convert FILE",
          file=sys.stderr)
    return 2


def convert_config(argv: list[str]) -> int:
    """`archipelago config convert FILE`: a torchtitan-format run file as our TOML."""
    import tomli_w

    from archipelago.config.loading import config_from_dict, read_toml
    from archipelago.config.torchtitan import convert, is_torchtitan

    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: archipelago config convert FILE\n\nPrint a torchtitan-format run file (the reference "
              "platform's) as an Archipelago TOML run file; keys with no equivalent are listed as comments.",
              file=sys.stderr if len(argv) != 1 else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    raw = read_toml(argv[0])
    if not is_torchtitan(raw):
        print(f"{argv[0]} is already in Archipelago's format (no torchtitan-only key such as "
              "[training] local_batch_size); nothing to convert", file=sys.stderr)
        return 2
    conversion = convert(raw, argv[0])
    config_from_dict(conversion.ours, argv[0])  # every mapped value fits our schema (ConfigError if not)
    order = [f.name for f in dataclasses.fields(Config)]  # sections in the order of our reference
    ours = {name: conversion.ours[name] for name in order if name in conversion.ours}
    header = [f"# Converted from {argv[0]} (torchtitan format) by `archipelago config convert`."]
    header += [f"# left out (no equivalent): {key}" for key in conversion.dropped]
    print("\n".join(header) + "\n\n" + tomli_w.dumps(ours), end="")
    return 0


def cmd_simulate(argv: list[str]) -> int:
    from archipelago.federation.simulate_cli import cli

    return cli(argv)


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "train": cmd_train, "data": cmd_data, "models": cmd_models, "report": cmd_report,
    "config": cmd_config, "export": cmd_export, "generate": cmd_generate, "lighthouse": cmd_lighthouse,
    "local": cmd_local, "secret": cmd_secret, "plan": cmd_plan, "doctor": cmd_doctor, "simulate": cmd_simulate,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        from archipelago.config.loading import closest

        hint = closest(argv[0], COMMANDS)
        print(f"archipelago: unknown command {argv[0]!r}" + (f"; did you mean {hint!r}?" if hint else "")
              + "\n\n" + USAGE, file=sys.stderr)
        return 2
    try:
        return command(argv[1:])
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # errors whose message already names the fix; others keep their traceback
        known = _known_failure(exc)
        if known is None:
            raise
        print(known[1], file=sys.stderr)
        return known[0]


if __name__ == "__main__":
    sys.exit(main())

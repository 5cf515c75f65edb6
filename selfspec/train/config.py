"""Settings of one training run (logged with the run, not saved with the heads).

Command-line flags map one to one onto ``TrainConfig`` fields (``--learning-rate`` -> ``learning_rate``);
``--config FILE`` (YAML or JSON) sets fields first, flags given explicitly override the file.
Head hyperparameters go through ``--head-arg KEY=VALUE`` into the family's own config dataclass, loss settings
through ``--loss-arg KEY=VALUE`` into its objective's (``selfspec/train/<family>.py``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ..dtypes import DTYPE_CHOICES
from ..errors import SelfspecError
from ..heads import FAMILIES
from ..zoo import DEFAULT_MODEL
from .objectives import loss_settings

# fields that moved into a family's loss settings: old name -> its key in loss_args (--loss-arg KEY=VALUE)
MOVED = {"medusa_decay": "decay", "eagle_token_weight": "token_weight", "eagle_unroll": "unroll",
         "eagle_unroll_decay": "decay"}


@dataclass
class TrainConfig:
    """One head-training run. ``loss`` (set when made, not a field): ``loss_args`` checked into the family's loss
    settings dataclass (its objective's ``args``)."""

    base_model: str = DEFAULT_MODEL  # zoo name, hub id or folder; loaded frozen
    dtype: str = "auto"  # the frozen target's: auto (measured by the main process, for all) | bfloat16 | float32
    family: str = "eagle"  # a registered head family: eagle3 | eagle | medusa | early-exit
    head_args: dict[str, Any] = field(default_factory=dict)  # the family's hyperparameters
    loss_args: dict[str, Any] = field(default_factory=dict)  # the family's loss settings (its objective's args)
    init_from: str = ""  # a heads folder to continue from (same family and shapes), e.g. a shorter run's
    warm_start: str = ""  # heads of any family for this target to start from: what fits copied, the rest reported
    recount_draft_vocab: bool = False  # EAGLE with --init-from or --warm-start: choose the draft vocabulary again from this run's data
    data: str = "sharegpt"  # sharegpt | humaneval | .json/.jsonl file (e.g. generate_data.py's) | a folder of .jsonl (selfspec serve --record) | hub id; or several, comma-separated
    data_ratio: str = ""  # shares of each --data source in the examples, comma-separated (e.g. 0.3,0.7: recorded traffic mixed with the original data); "" = sources fill in order
    max_examples: int = 2000
    max_length: int = 512
    heldout_fraction: float = 0.02
    output_dir: str = "runs/heads"
    cache_features: bool = True  # run the target once, keep its hidden states on disk (safetensors shards)
    feature_dir: str = ""  # where the cached states live ("" = OUTPUT_DIR/features); runs may share one
    epochs: int = 2
    batch_size: int = 4  # sequences per optimizer micro-step
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    max_grad_norm: float = 1.0
    mixed_precision: str = "no"  # no | bf16 | fp16 (accelerate)
    save_every: int = 100  # optimizer steps between resumable checkpoints
    eval_examples: int = 32  # held-out examples for per-depth top-1 accuracy
    seed: int = 0
    resume: bool = False
    max_steps: int = 0  # stop after this many optimizer steps (0 = run all epochs)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise SelfspecError(f"unknown head family '{self.family}'; choose one of {', '.join(FAMILIES)}")
        if self.dtype not in DTYPE_CHOICES:
            raise SelfspecError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype}")
        self.quotas(1)  # a --data-ratio that cannot be read is refused now
        if self.mixed_precision not in ("no", "bf16", "fp16"):
            raise SelfspecError("mixed_precision must be no, bf16 or fp16")
        if min(self.batch_size, self.gradient_accumulation_steps, self.epochs, self.save_every) < 1:
            raise SelfspecError("batch_size, gradient_accumulation_steps, epochs and save_every must be >= 1")
        if self.warm_start and self.init_from:
            raise SelfspecError("--warm-start and --init-from both choose where the heads start: give one")
        self.loss = loss_settings(self.family, self.loss_args)  # checked now, before any model loads

    @property
    def sources(self) -> list[str]:
        """``data`` split at commas."""
        return [s.strip() for s in self.data.split(",") if s.strip()]

    def quotas(self, limit: int) -> list[int] | None:
        """Examples each source gives out of ``limit`` by ``data_ratio`` (None: in order, each filling the rest)."""
        if not self.data_ratio:
            return None
        try:
            shares = [float(x) for x in self.data_ratio.split(",")]
        except ValueError:
            shares = []
        if len(shares) != len(self.sources) or min(shares, default=-1) < 0 or sum(shares) <= 0:
            raise SelfspecError(f"--data-ratio {self.data_ratio}: one share >= 0 per --data source "
                                f"({len(self.sources)}), not all 0")
        counts = [int(limit * share / sum(shares)) for share in shares]
        counts[-1] += limit - sum(counts)
        return counts


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


DICT_FLAGS = {"head_args": ("--head-arg", "a head hyperparameter, e.g. --head-arg num_heads=4 (repeatable)"),
              "loss_args": ("--loss-arg", "a loss setting of the family's objective, e.g. --loss-arg unroll=4 "
                                          "(repeatable; selfspec/objectives/<family>.py lists them)")}


def build_parser() -> argparse.ArgumentParser:
    """One flag per ``TrainConfig`` field, defaults left unset so a config file can supply them."""
    p = argparse.ArgumentParser(description="Train selfspec draft heads on a frozen target (accelerate launch or python).")
    p.add_argument("--config", help="YAML or JSON file of TrainConfig fields")
    for f in fields(TrainConfig):
        default = f.default if f.default is not MISSING else f.default_factory()
        if f.name in DICT_FLAGS:
            p.add_argument(DICT_FLAGS[f.name][0], dest=f.name, action="append", metavar="KEY=VALUE",
                           help=DICT_FLAGS[f.name][1])
        elif isinstance(default, bool):
            p.add_argument(_flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                           help=f"(default {default})")
        else:
            p.add_argument(_flag(f.name), dest=f.name, type=type(default), default=None, help=f"(default {default})")
    return p


def load_config_file(path: str) -> dict[str, Any]:
    """Fields from a YAML (needs PyYAML) or JSON file."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SelfspecError(f"cannot read config file {path}: {exc.strerror}") from exc
    try:
        if path.endswith((".yaml", ".yml")):
            try:
                import yaml
            except ImportError as exc:
                raise SelfspecError("a YAML config needs PyYAML (pip install pyyaml); or use JSON") from exc
            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                raise SelfspecError(f"{path} is not valid YAML: {exc}") from exc
        else:
            data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SelfspecError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise SelfspecError(f"{path} must hold a mapping of TrainConfig fields")
    known = {f.name for f in fields(TrainConfig)}
    moved = sorted(set(data) & set(MOVED))
    if moved:
        keys = ", ".join(f"{k} -> {MOVED[k]}" for k in moved)
        raise SelfspecError(f"{path}: fields moved into \"loss_args\" (the family's loss settings): {keys}")
    unknown = sorted(set(data) - known)
    if unknown:
        raise SelfspecError(f"{path}: unknown TrainConfig fields {unknown}")
    return data


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """The run's config from a file (optional) and flags."""
    args = build_parser().parse_args(argv)
    values: dict[str, Any] = load_config_file(args.config) if args.config else {}
    for f in fields(TrainConfig):
        given = getattr(args, f.name)
        if given is None:
            continue
        if f.name in DICT_FLAGS:
            pairs = {}
            for item in given:
                if "=" not in item:
                    raise SelfspecError(f"{DICT_FLAGS[f.name][0]} takes KEY=VALUE, got '{item}'")
                key, value = item.split("=", 1)
                pairs[key] = _parse_value(value)
            values[f.name] = {**values.get(f.name, {}), **pairs}
        else:
            values[f.name] = given
    return TrainConfig(**values)


def config_dict(cfg: TrainConfig) -> dict[str, Any]:
    """JSON-ready form, for the run log (``loss_args`` as given; the checked settings are ``cfg.loss``)."""
    return asdict(cfg)

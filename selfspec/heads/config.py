"""Head architectures as dataclasses: what ``selfspec_heads.json`` stores beside the trained weights.

Each config describes one family's trained module (shapes, counts) plus the decoding defaults that
belong with it (Medusa's static tree, EAGLE's expansion width). ``None`` fields mean "derive from
the target"; ``resolved(target_config)`` fills them in, and checkpoints always store resolved values,
so a loaded head is rebuilt with exactly the shapes it was trained with. Training-run settings
(learning rate, data) are not here: they belong to the run's log.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, ClassVar

from transformers import PretrainedConfig

from ..errors import SelfspecError
from ..frozen import text_config

# Paths of top-k ranks, one rank per Medusa head: [0, 1] = head 1's best token, then head 2's
# second best. Prefixes come first; 15 nodes + the root fill the engine's default 16-node budget.
DEFAULT_MEDUSA_TREE: tuple[tuple[int, ...], ...] = (
    (0,), (0, 0), (1,), (0, 0, 0), (0, 1), (2,), (1, 0), (0, 0, 0, 0),
    (0, 0, 1), (0, 2), (3,), (2, 0), (0, 1, 0), (1, 1), (0, 0, 0, 1),
)


class FamilyConfig:
    """What every family's config answers besides its fields (a family with other needs overrides it)."""

    family: ClassVar[str]

    def copied_parameters(self, vocab_size: int, hidden_size: int) -> int:
        """Parameters the drafter copies out of the target while drafting, beyond the trained ones: none."""
        return 0


@dataclass
class MedusaConfig(FamilyConfig):
    """K parallel heads on the target's last hidden state; head k predicts the token k places after the root."""

    family: ClassVar[str] = "medusa"
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head
    tree: list[list[int]] | None = None  # None: DEFAULT_MEDUSA_TREE's paths that fit num_heads

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 1:
            raise SelfspecError(f"medusa needs num_heads >= 1 and num_layers >= 1, "
                                f"got {self.num_heads}, {self.num_layers}")
        if self.tree is None:
            self.tree = [list(p) for p in DEFAULT_MEDUSA_TREE if len(p) <= self.num_heads]
        self.tree = [list(map(int, p)) for p in self.tree]
        bad = [p for p in self.tree if not p or len(p) > self.num_heads or min(p) < 0]
        if bad:
            raise SelfspecError(f"medusa tree paths must be non-empty, at most {self.num_heads} long, "
                                f"with ranks >= 0; bad: {bad[:3]}")

    def resolved(self, target_config: PretrainedConfig) -> MedusaConfig:
        """Nothing to derive: Medusa's shapes come from the target's hidden size alone."""
        return replace(self)


@dataclass
class EagleConfig(FamilyConfig):
    """One decoder layer of the target's own class over (feature, next-token embedding) pairs.

    ``intermediate_size`` narrows the layer's MLP (None: twice the hidden size, capped at the
    target's); ``draft_vocab_size`` drafts over that many frequent tokens only (None: all of a
    vocabulary up to 32768 tokens, else 32768); ``top_k``: children per expanded node, and nodes
    expanded per depth, of the EAGLE-2 dynamic tree; ``norms``: False builds EAGLE-1's layout, the one
    vLLM loads (``EagleLlamaForCausalLM``): no input norms, no norm before the layer's attention, no
    final norm (``selfspec export --format vllm`` writes it; vLLM drafts over the whole vocabulary).
    """

    family: ClassVar[str] = "eagle"
    intermediate_size: int | None = None
    draft_vocab_size: int | None = None
    top_k: int = 4
    norms: bool = True

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise SelfspecError(f"{self.family} top_k must be >= 1, got {self.top_k}")
        for name in ("intermediate_size", "draft_vocab_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise SelfspecError(f"{self.family} {name} must be >= 1, got {value}")

    def resolved(self, target_config: PretrainedConfig) -> EagleConfig:
        """Fill in the MLP width and draft vocabulary from the target's config."""
        tc = text_config(target_config)
        width = self.intermediate_size or min(2 * tc.hidden_size, getattr(tc, "intermediate_size", 2 * tc.hidden_size))
        vocab = self.draft_vocab_size or min(tc.vocab_size, 32768)
        if vocab > tc.vocab_size:
            raise SelfspecError(f"eagle draft_vocab_size {vocab} exceeds the target's vocabulary ({tc.vocab_size})")
        return replace(self, intermediate_size=width, draft_vocab_size=vocab)

    def copied_parameters(self, vocab_size: int, hidden_size: int) -> int:
        """A reduced draft vocabulary's rows of the target's LM head, gathered once when drafting starts."""
        vocab = self.draft_vocab_size
        return vocab * hidden_size if vocab and vocab < vocab_size else 0


@dataclass
class EarlyExitConfig(FamilyConfig):
    """Draft with the target's first ``exit_layer`` layers (shared, not copied), an exit adapter, the final
    norm's output and the target's LM head.

    ``adapter``: what is trained between the exit and the LM head.
      "projection"  a zero-initialised residual projection ``h + W h`` (``exit_projection`` False: nothing)
      "layer"       one decoder layer of the target's own class over the exit states (Kangaroo's adapter): it
                    attends over the exit states of the sequence so far; its MLP is ``adapter_intermediate_size``
                    wide (None: the hidden size); its output projections start at zero, so an untrained
                    adapter drafts what the plain exit drafts
      "lora"        LoRA of rank ``lora_rank`` (scale ``lora_alpha / lora_rank``; None: alpha = 2 * rank) on every
                    projection of the first ``exit_layer`` layers, active only in the drafter's copy of them
                    (``exit_lora.py``); saved also as a peft adapter folder
    ``exit_layer`` None: a quarter of the target's layers (LayerSkip's choice for drafting).
    ``draft_vocab_size``: draft over the most frequent tokens of the training data only (a slice of the target's
    LM head rows, gathered once per generation: on a small model the LM head costs more than the first layers);
    None: the whole vocabulary.
    ``top_k``: children per expanded node, and nodes expanded per depth, of the EAGLE-2 dynamic tree the drafter
    grows (each depth one pass of the first L layers and the adapter over k nodes); 1: a chain.
    """

    family: ClassVar[str] = "early-exit"
    exit_layer: int | None = None
    exit_projection: bool = True
    adapter: str = "projection"
    adapter_intermediate_size: int | None = None
    lora_rank: int = 16
    lora_alpha: float | None = None
    draft_vocab_size: int | None = None
    top_k: int = 4

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise SelfspecError(f"early-exit top_k must be >= 1, got {self.top_k}")
        if self.lora_rank < 1:
            raise SelfspecError(f"early-exit lora_rank must be >= 1, got {self.lora_rank}")
        if self.adapter not in EXIT_ADAPTERS:
            raise SelfspecError(f"early-exit adapter must be one of {', '.join(EXIT_ADAPTERS)}, got '{self.adapter}'")
        if self.adapter_intermediate_size is not None and self.adapter_intermediate_size < 1:
            raise SelfspecError(f"early-exit adapter_intermediate_size must be >= 1, got {self.adapter_intermediate_size}")

    def resolved(self, target_config: PretrainedConfig) -> EarlyExitConfig:
        """Fill in and check the exit layer against the target's depth, and the adapter layer's width."""
        tc = text_config(target_config)
        n = tc.num_hidden_layers
        layer = self.exit_layer if self.exit_layer is not None else max(1, n // 4)
        if not 1 <= layer <= n:
            raise SelfspecError(f"early-exit exit_layer must lie in [1, {n}] for this target, got {layer}")
        width = self.adapter_intermediate_size or (tc.hidden_size if self.adapter == "layer" else None)
        alpha = self.lora_alpha if self.lora_alpha is not None or self.adapter != "lora" else 2 * self.lora_rank
        vocab = self.draft_vocab_size
        if vocab is not None and not 1 <= vocab <= tc.vocab_size:
            raise SelfspecError(f"early-exit draft_vocab_size must lie in [1, {tc.vocab_size}], got {vocab}")
        vocab = None if vocab == tc.vocab_size else vocab
        return replace(self, exit_layer=layer, adapter_intermediate_size=width, lora_alpha=alpha,
                       draft_vocab_size=vocab)

    def copied_parameters(self, vocab_size: int, hidden_size: int) -> int:
        """The draft vocabulary's rows of the target's LM head, gathered when drafting starts."""
        vocab = self.draft_vocab_size
        return vocab * hidden_size if vocab and vocab < vocab_size else 0


EXIT_ADAPTERS = ("projection", "layer", "lora")


HeadConfig = FamilyConfig  # any registered family's config dataclass
CONFIGS: dict[str, type] = {}  # family -> config dataclass, filled by ``selfspec.heads.register_family``


def config_class(family: str) -> type:
    """The config dataclass of ``family``, or a one-line error naming the known families."""
    if family not in CONFIGS:
        raise SelfspecError(f"unknown head family '{family}'; known: {', '.join(CONFIGS)}")
    return CONFIGS[family]


def config_to_dict(config: HeadConfig) -> dict[str, Any]:
    """JSON-ready fields of a head config (the family is stored beside it)."""
    return asdict(config)


def config_from_dict(family: str, data: dict[str, Any]) -> HeadConfig:
    """Rebuild a head config; keys this version does not know are dropped with a warning."""
    cls = config_class(family)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        warnings.warn(f"ignoring unknown {family} config keys {unknown} (written by another selfspec version?)",
                      stacklevel=2)
    return cls(**{k: v for k, v in data.items() if k in known})


def make_config(family: str, **hyperparams: Any) -> HeadConfig:
    """A config from keyword hyperparameters; a misspelt one is an error (unlike loading, a user typed it)."""
    cls = config_class(family)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(hyperparams) - known)
    if unknown:
        raise SelfspecError(f"unknown {family} hyperparameters {unknown}; known: {sorted(known)}")
    return cls(**hyperparams)

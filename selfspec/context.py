"""How many positions a model reads, and the check that a request stays within them."""

from __future__ import annotations

from transformers import PretrainedConfig

from .errors import SelfspecError


def context_length(config: PretrainedConfig) -> int | None:
    """The positions the model was built for (``max_position_embeddings``), or None when its config does not say."""
    return getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)


def check_fits(config: PretrainedConfig, prompt_tokens: int, max_new_tokens: int) -> None:
    """One clear error when the prompt plus ``max_new_tokens`` would run past the model's context: positions
    beyond it were never trained, and decoding there gives text that only looks like an answer."""
    limit = context_length(config)
    if limit is None or prompt_tokens + max_new_tokens <= limit:
        return
    if prompt_tokens >= limit:
        raise SelfspecError(f"the prompt is {prompt_tokens:,} tokens long, but the model reads at most {limit:,} "
                            "positions (max_position_embeddings): shorten the prompt")
    raise SelfspecError(f"the prompt ({prompt_tokens:,} tokens) and up to {max_new_tokens:,} new tokens would run "
                        f"past the {limit:,} positions the model reads (max_position_embeddings): shorten the prompt "
                        f"or ask for at most {limit - prompt_tokens:,} new tokens")

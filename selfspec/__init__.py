"""selfspec: self-speculative decoding for Hugging Face causal LMs.

Start with :class:`selfspec.engine.SpeculativeEngine` (the lossless loop), a drafter from
:mod:`selfspec.drafters` or :mod:`selfspec.heads`, and :func:`selfspec.zoo.load_model`.
Importing selfspec has no side effects: nothing is loaded, parsed or downloaded.
"""

__version__ = "0.1.0"

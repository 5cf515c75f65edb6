"""The head families' training objectives: what each head predicts from the target's features and its loss.

A leaf package: it imports torch, ``selfspec.frozen`` and ``selfspec.tree`` only, so ``selfspec.heads`` (whose
registry joins each family's config, module, drafter and objective) and ``selfspec.train`` (the loop that
optimizes them) both import it and neither imports the other back through it.

    common.py      the ``Objective`` contract every family fills, and the helpers they share
    eagle.py, eagle3.py, medusa.py, early_exit.py   one family each
"""

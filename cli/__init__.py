"""The ``selfspec`` command (installed as ``selfspec_cli``): a thin layer above the library and the benchmark.

    main.py      the parser: one argparse subcommand per module in COMMANDS; errors as one line
    models.py    selfspec models list|fetch
    generate.py  selfspec generate: one prompt, streamed or as JSON
    demo.py      selfspec demo: plain and speculative decoding side by side
    info.py      selfspec info: what a heads checkpoint costs beside its base
    (bench)      selfspec bench: selfspec_eval.bench (eval/bench.py)

A subcommand is a module with ``HELP``, ``add_arguments(parser)`` and ``run(args) -> exit status``;
``COMMANDS`` in main.py lists them. The options they share are defined once, in ``selfspec/options.py``.
"""

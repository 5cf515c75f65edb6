"""selfspec's evaluation code (installed as the ``selfspec_eval`` package; ``selfspec bench`` runs it).

    prompts.py   benchmark prompts by category: chat, code, users' jsonl (prompt or MT-bench form)
    methods.py   the compared methods (transformers, transformers assisted, selfspec with each drafter)
    runs.py      what one prompt through one method measured (a row of runs.jsonl)
    metrics.py   per method x category: tokens/s, speedup, tau, acceptance per depth, identical output
    budgets.py   memory added per method (counted and predicted) and what fits a memory budget
    report.py    JSON, Markdown and PNG plots
    bench.py     the command (``selfspec bench``, options shared through ``selfspec.options``): runs everything
                 interleaved, resumable, and writes the report
    vllm_client.py  vLLM's methods: a worker process in vLLM's own environment (vllm_worker.py)
    gpu_check.py the prepared GPU run (``make gpu-check``): CUDA tests, compiled pass, heads training, benches;
                 smoke size on a CPU; its report: gpu_report.py
"""

"""selfspec serve: an OpenAI-compatible HTTP server with speculative decoding (selfspec/serve/).

    selfspec serve --model smollm2-135m-instruct --heads checkpoints/smollm2-135m-instruct-eagle
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}]}'

/v1/chat/completions and /v1/completions (streamed or not), /v1/models, /health, /metrics (Prometheus).
Requests decode together, up to --max-batch at a time (continuous batching: one target pass per step for all of
them, the draft depth sized to the load); --queue-size more may wait for a row, more get 429.
Streams are paced (tokens committed in bursts sent at the measured rate) unless --no-smoothing or a
request's "smooth": false. --max-new-tokens is the default for requests that set no max_tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from selfspec.options import (add_decoding_options, add_drafter_options, add_model_options, decode_config,
                              load_target, positive_float, positive_int)

from .generate import build_drafter

DEFAULT_MAX_BATCH = 16
KEY_ENV = "SELFSPEC_API_KEY"
HELP = "serve the model over an OpenAI-compatible HTTP API (chat and completions, streaming, metrics)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Where to listen, the queue, smoothing, and the shared model / decoding / drafting options."""
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    g.add_argument("--port", type=positive_int, default=8000)
    g.add_argument("--served-model-name", help="the model name clients send (default: --model)")
    g.add_argument("--max-batch", type=positive_int, default=None,
                   help="requests decoded together (default: as many as fit half the free memory with --max-context "
                        f"positions each, at most {DEFAULT_MAX_BATCH})")
    g.add_argument("--max-context", type=positive_int, default=None,
                   help="positions per request, prompt + answer (default: the model's, at most 4096)")
    g.add_argument("--prefix-cache", type=float, default=256, metavar="MIB",
                   help="MiB of prompts' KV kept for later prompts that start the same way (a repeated question, a "
                        "shared system prompt, a chat's earlier turns): reused exactly, never changing a token; the "
                        "least recently used go first past this bound; its size in /metrics (selfspec_memory_bytes"
                        "{part=\"prefix_cache\"}); 0: off (default: %(default)s)")
    g.add_argument("--queue-size", type=positive_int, default=16,
                   help="requests that may wait for a row of the batch; more are refused with 429 (default: %(default)s)")
    g.add_argument("--no-smoothing", action="store_true", help="send tokens as steps commit them, in bursts")
    g.add_argument("--graceful-timeout", type=positive_int, default=30,
                   help="on shutdown, seconds to let requests in flight finish before cancelling them")
    g.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="info: one access-log line per request (id, status, tokens, TTFT, duration; no prompt text)")
    g.add_argument("--log-prompts", action="store_true", help="put each request's prompt text in its access-log line")
    g.add_argument("--request-timeout", type=positive_float, default=None, metavar="S",
                   help="seconds a request may take from arrival; then it ends with a 408 error and frees its row "
                        "(default: no limit)")
    g.add_argument("--max-body-mib", type=positive_float, default=8, metavar="MIB",
                   help="largest request body; larger ones get 413 (default: %(default)s)")
    a = p.add_argument_group("access")
    a.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* and /metrics (repeat for several keys; "
                        f"default: the comma-separated keys in ${KEY_ENV}, else none: anyone who reaches the port)")
    a.add_argument("--metrics-public", action="store_true", help="serve /metrics without a key")
    r = p.add_argument_group("recording (off by default: what clients send is their users' words)")
    r.add_argument("--record", metavar="DIR", help="append every finished request (its messages, the answer the "
                   "client got, finish reason, token counts, sampling settings, id, time) to JSON Lines files in DIR, "
                   "which `training/train_heads.py --data DIR` reads; a request with \"store\": false is never "
                   "recorded, nor one that failed or whose client left")
    r.add_argument("--record-max-mib", type=positive_float, default=64, metavar="MIB",
                   help="start a new file in DIR once the current one holds this much (default: %(default)s)")
    p.add_argument("--drafter", choices=["none", "draft-model", "prompt-lookup", "suffix"], default="prompt-lookup",
                   help="what drafts when no --heads are given (default: %(default)s; suffix: the request's own "
                   "context and every answer served before, except those sent with \"store\": false)")
    p.add_argument("--suffix-scope", choices=["global", "key"], default="global",
                   help="--drafter suffix: whose earlier answers a request's drafts come from: every request's "
                        "(global, the default) or its own API key's only (key: one client's answers never shape "
                        "another's drafts or timing; --suffix-max-mib is split evenly between the keys)")
    add_model_options(p)
    add_decoding_options(p, max_new_tokens=512)
    add_drafter_options(p)


def run(args: argparse.Namespace) -> int:
    """Load the model and drafter, warm the engine up, serve until interrupted."""
    preload_intel_openmp()
    from selfspec.batching import BatchEngine
    from selfspec.engine import DecodeConfig
    from selfspec.errors import SelfspecError
    from selfspec.dtypes import dtype_name
    from selfspec.memory import free_memory, model_dtype

    try:
        from selfspec.serve import ServerConfig, run as serve
    except ImportError as exc:  # before the model loads
        raise SelfspecError(f"serving needs {exc.name}: pip install 'selfspec[serve]'") from None
    keys = api_keys(args)
    rec = recorder(args)  # a folder that cannot be written is refused before the model loads
    if not keys and not is_loopback(args.host):
        print(f"selfspec serve: warning: listening on {args.host} without an API key: anyone who reaches the port "
              f"can use the model (--api-key KEY or ${KEY_ENV})", file=sys.stderr, flush=True)
    if args.target_pass in ("eager", "compiled"):
        raise SelfspecError(f"selfspec serve batches requests over the static pass; --target-pass {args.target_pass} "
                            "is for single requests (selfspec generate, bench)")
    if args.suffix_scope == "key" and (args.drafter != "suffix" or not keys):
        raise SelfspecError("--suffix-scope key keeps a suffix index per API key: it needs --drafter suffix and "
                            f"--api-key (or ${KEY_ENV})")
    model, tokenizer = load_target(args)
    drafter = build_drafter(args, model, tokenizer, suffix_scopes=len(keys) if args.suffix_scope == "key" else 0)
    engine = BatchEngine(model, drafter, tokenizer, max_batch=max_batch(args, model), context=args.max_context,
                         exact=args.exact, memory_bytes=free_memory(model.device),
                         prefix_cache=int(args.prefix_cache * 2**20))
    engine.check_config(decode_config(args))  # settings that cannot work: refused now, not on every request
    engine.generate_batch([tokenizer.encode("Hello")[:4] or [0]], DecodeConfig(max_new_tokens=4))  # first passes now
    engine.calibrate()  # what passes of 1-64 tokens cost here: the draft budget's starting point
    config = ServerConfig(model_name=args.served_model_name or args.model, max_waiting=args.queue_size,
                          smooth=not args.no_smoothing, default_max_tokens=args.max_new_tokens,
                          decode=decode_config(args), api_keys=keys, metrics_public=args.metrics_public,
                          max_body=int(args.max_body_mib * 2**20), request_timeout=args.request_timeout,
                          log_prompts=args.log_prompts, recorder=rec, heads=args.heads, suffix_scope=args.suffix_scope,
                          load_heads=heads_loader(args, model, tokenizer, drafter) if args.heads else None)
    cache = f"{args.prefix_cache:g} MiB prefix cache" if engine.prefix is not None else "no prefix cache"
    access = f"{len(keys)} API key{'s' if len(keys) > 1 else ''}" if keys else "no API key"
    print(f"selfspec serve: {config.model_name} in {dtype_name(model_dtype(model))} (batches of up to "
          f"{engine.max_batch} x {engine.context:,} positions, {cache}, drafter {getattr(drafter, 'name', 'none')}, "
          f"{access}) on http://{args.host}:{args.port}/v1", flush=True)
    serve(engine, tokenizer, config, host=args.host, port=args.port, log_level=args.log_level,
          graceful_timeout=args.graceful_timeout)
    return 0


def heads_loader(args: argparse.Namespace, model, tokenizer, first):
    """A heads folder -> its drafter, built as --heads built the serving one (POST /v1/heads/reload)."""
    import copy

    def load(folder: str):
        again = copy.copy(args)
        again.heads = folder
        drafter = build_drafter(again, model, tokenizer)
        if args.drafter == "suffix":  # newer heads keep the suffix indexes of everything served so far
            drafter.lookup = first.lookup
        return drafter

    return load


def recorder(args: argparse.Namespace):
    """--record's recorder, or None."""
    if not args.record:
        return None
    from selfspec.serve.record import Recorder

    return Recorder(args.record, int(args.record_max_mib * 2**20))


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key (repeated), else ``$SELFSPEC_API_KEY`` split at commas; empty: no key needed."""
    keys = args.api_key if args.api_key else os.environ.get(KEY_ENV, "").split(",")
    return tuple(dict.fromkeys(k.strip() for k in keys if k.strip()))


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def max_batch(args: argparse.Namespace, model) -> int:
    """--max-batch, or as many requests as fit half the free memory (at least 1, at most ``DEFAULT_MAX_BATCH``)."""
    from selfspec.batching import default_context
    from selfspec.memory import free_memory, kv_bytes_per_token, model_dtype
    from selfspec.target.common import BUCKETS

    if args.max_batch:
        return args.max_batch
    free = free_memory(model.device)
    if free is None:
        return DEFAULT_MAX_BATCH
    row = kv_bytes_per_token(model.config, model_dtype(model)) * ((args.max_context or default_context(model.config))
                                                                 + BUCKETS[-1])
    return max(1, min(DEFAULT_MAX_BATCH, free // 2 // row))


def preload_intel_openmp() -> None:
    """Start again with Intel OpenMP preloaded where the ``serve`` extra installed it (x86-64 Linux), as vLLM's CPU
    backend does: the model's threads then share the cores with the HTTP server and its clients far better than
    with torch's own GNU OpenMP (SmolLM2-135M, 2 cores, 2 threads, 4 clients: 76 -> 113 tokens/s). Intel's threads
    spin 5 ms before sleeping (``KMP_BLOCKTIME``, as vLLM sets it) unless the environment says otherwise."""
    lib = Path(sys.prefix) / "lib" / "libiomp5.so"
    preload = os.environ.get("LD_PRELOAD", "")
    started_as_serve = sys.argv[1:2] == ["serve"]  # not `main([...])` called inside another program
    if not lib.is_file() or "libiomp5" in preload or os.environ.get("SELFSPEC_NO_IOMP") or not started_as_serve:
        return
    env = {**os.environ, "LD_PRELOAD": ":".join(filter(None, [str(lib), preload])), "SELFSPEC_NO_IOMP": "1"}
    env.setdefault("KMP_BLOCKTIME", "5")
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "selfspec_cli", *sys.argv[1:]], env)

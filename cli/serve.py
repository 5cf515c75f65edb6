"""selfspec serve: an OpenAI-compatible HTTP server with speculative decoding (selfspec/serve/).

    selfspec serve --model smollm2-135m-instruct --heads checkpoints/smollm2-135m-instruct-eagle
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}]}'

/v1/chat/completions and /v1/completions (streamed or not), /v1/models, /health, /metrics (Prometheus).
One engine decodes one request at a time; --queue-size requests may wait behind it, more get 429.
Streams are paced (tokens committed in bursts sent at the measured rate) unless --no-smoothing or a
request's "smooth": false. --max-new-tokens is the default for requests that set no max_tokens.
"""

from __future__ import annotations

import argparse

from selfspec.options import (add_decoding_options, add_drafter_options, add_model_options, decode_config,
                              load_target, positive_int)

from .generate import build_drafter

HELP = "serve the model over an OpenAI-compatible HTTP API (chat and completions, streaming, metrics)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Where to listen, the queue, smoothing, and the shared model / decoding / drafting options."""
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    g.add_argument("--port", type=positive_int, default=8000)
    g.add_argument("--served-model-name", help="the model name clients send (default: --model)")
    g.add_argument("--queue-size", type=positive_int, default=16,
                   help="requests that may wait behind the one decoding; more are refused with 429 (default: %(default)s)")
    g.add_argument("--no-smoothing", action="store_true", help="send tokens as steps commit them, in bursts")
    g.add_argument("--graceful-timeout", type=positive_int, default=30,
                   help="on shutdown, seconds to let requests in flight finish before cancelling them")
    g.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--drafter", choices=["none", "draft-model", "prompt-lookup"], default="prompt-lookup",
                   help="what drafts when no --heads are given (default: %(default)s)")
    add_model_options(p)
    add_decoding_options(p, max_new_tokens=512)
    add_drafter_options(p)


def run(args: argparse.Namespace) -> int:
    """Load the model and drafter, warm the engine up, serve until interrupted."""
    from selfspec.engine import DecodeConfig, SpeculativeEngine
    from selfspec.errors import SelfspecError

    try:
        from selfspec.serve import ServerConfig, run as serve
    except ImportError as exc:  # before the model loads
        raise SelfspecError(f"serving needs {exc.name}: pip install 'selfspec[serve]'") from None
    model, tokenizer = load_target(args)
    drafter = build_drafter(args, model, tokenizer)
    engine = SpeculativeEngine(model, drafter, tokenizer, backend=args.target_pass, exact=args.exact)
    engine.check_config(decode_config(args))  # settings that cannot work: refused now, not on every request
    engine.generate(tokenizer.encode("Hello")[:4] or [0], DecodeConfig(max_new_tokens=4))  # first-pass costs now
    config = ServerConfig(model_name=args.served_model_name or args.model, max_waiting=args.queue_size,
                          smooth=not args.no_smoothing, default_max_tokens=args.max_new_tokens,
                          decode=decode_config(args))
    print(f"selfspec serve: {config.model_name} ({engine.target.name} pass, drafter "
          f"{getattr(drafter, 'name', 'none')}) on http://{args.host}:{args.port}/v1", flush=True)
    serve(engine, tokenizer, config, host=args.host, port=args.port, log_level=args.log_level,
          graceful_timeout=args.graceful_timeout)
    return 0

"""The OpenAI request and response shapes the server speaks, and its errors.

Requests are checked field by field as they are parsed (pydantic): a value out of range or a malformed
message is a 422 with OpenAI's error JSON; what parses but cannot be served (``n > 1``, penalties, a model
name the server does not have, a prompt past the context) is a 400 or 404 raised as :class:`APIError`.
Fields OpenAI defines and selfspec ignores (``user``, ``metadata``, ...) are accepted and ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..engine import DecodeConfig
from ..sampling import SamplingConfig


class APIError(Exception):
    """An error answered as ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class TextPart(BaseModel):
    """One part of a message's content list (text only)."""

    type: Literal["text"]
    text: str


class Message(BaseModel):
    """One chat message."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampled(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # not OpenAI's; vLLM's name for it
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logprobs: bool | int | None = None
    smooth: bool | None = None  # selfspec: pace the stream (None: the server's default)
    store: bool | None = None  # OpenAI's: false keeps this request out of --record's files and the suffix drafter

    def check_supported(self) -> None:
        """400 for what parses but selfspec does not do."""
        if self.n != 1:
            raise APIError(400, "n > 1 is not supported: selfspec decodes one sequence per request", param="n")
        if self.presence_penalty or self.frequency_penalty:
            raise APIError(400, "presence and frequency penalties are not supported: they change the model's "
                                "distribution, which speculative decoding reproduces exactly", param="presence_penalty")
        if self.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        stops = self.stop_strings()
        if len(stops) > 4 or any(not s for s in stops):
            raise APIError(400, "stop takes up to 4 non-empty strings", param="stop")

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def decode_config(self, max_new_tokens: int, defaults: DecodeConfig) -> DecodeConfig:
        """The engine's settings for this request (drafting settings from the server's ``defaults``)."""
        sampling = SamplingConfig(self.temperature, self.top_k, self.top_p)
        return DecodeConfig(max_new_tokens=max_new_tokens, sampling=sampling, stop_strings=self.stop_strings(),
                            max_depth=defaults.max_depth, max_nodes=defaults.max_nodes, adaptive=defaults.adaptive,
                            seed=self.seed, remember=self.store is not False)


class ChatRequest(Sampled):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def wanted_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(Sampled):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[int] | list[str]
    echo: bool = False
    suffix: str | None = None

    def wanted_tokens(self) -> int | None:
        return self.max_tokens

    def check_supported(self) -> None:
        super().check_supported()
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise APIError(400, "one prompt per request: selfspec does not batch", param="prompt")
        if isinstance(self.prompt, list) and not self.prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        if self.echo or self.suffix:
            raise APIError(400, "echo and suffix are not supported", param="echo" if self.echo else "suffix")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_response(rid: str, model: str, text: str, finish: str, use: dict, extra: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish}], "usage": use, "selfspec": extra}


def completion_response(rid: str, model: str, text: str, finish: str, use: dict, extra: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], "usage": use,
            "selfspec": extra}


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def completion_chunk(rid: str, model: str, text: str, finish: str | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def usage_chunk(rid: str, model: str, kind: str, use: dict) -> dict:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": [], "usage": use}

"""Request bodies of the OpenAI-compatible API (/v1/completions, /v1/chat/completions).

What OpenAI clients send and we serve is accepted; what we cannot honour is refused by name: an
unknown field (``tools``, ``functions``, ``logit_bias``, ``response_format``, ...) is a 400 that
names it, and so is a supported field with a value we do not implement (``n`` > 1, a non-zero
penalty, ``best_of`` > 1). Types are strict.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.sampling import MAX_LOGPROBS


class Unsupported(ValueError):
    """A field whose value this server does not implement; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class CommonFields(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None  # informational only
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens (benchmarks)

    def check_supported(self) -> None:
        if self.n != 1:
            raise Unsupported("n", f"n = {self.n}: only one choice per request is supported")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0.0:
                raise Unsupported(name, f"{name} is not supported; leave it at 0")

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(CommonFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of not in (None, 1):
            raise Unsupported("best_of", "best_of > 1 is not supported")
        if self.suffix:
            raise Unsupported("suffix", "suffix (insertion) is not supported")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: str
    content: str
    name: str | None = None


class ChatCompletionRequest(CommonFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

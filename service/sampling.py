"""Sampling parameters of one request (pure; validated with messages that name the field)."""

from __future__ import annotations

from dataclasses import dataclass, field

from service.errors import RequestError

MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's API allows


class SamplingError(RequestError):
    """An invalid sampling value; ``field`` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"sampling_params.{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: all
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    # log-probabilities to return: of each generated token with this many alternatives (None:
    # none), and of each prompt token given the ones before it (for log-likelihood scoring)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise SamplingError(
                "max_new_tokens", f"must be an integer, got {self.max_new_tokens!r}"
            )
        if self.max_new_tokens < 1:
            raise SamplingError("max_new_tokens", f"must be at least 1, got {self.max_new_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise SamplingError("temperature", f"must be within [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError("top_p", f"must be within (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise SamplingError("top_k", f"must be -1 (all) or at least 1, got {self.top_k}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingError("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise SamplingError("stop_token_ids", "must be non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise SamplingError(name, f"must be within [0, {MAX_LOGPROBS}], got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

"""Request bodies of the HTTP API (SGLang-compatible `/generate`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from service.sampling import SamplingParams


class SamplingParamsIn(BaseModel):
    """Unknown fields are refused (a typo must not be silently ignored), and types are strict:
    ``"1"`` or ``true`` is not a count, nor an int a flag."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None

    def to_params(self) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            seed=self.seed,
        )


class GenerateRequest(BaseModel):
    """`text` or `input_ids`, one prompt or a list. Unknown top-level fields are refused (a
    misspelt ``sampling_param`` must not run with defaults); types are strict."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParamsIn | list[SamplingParamsIn] | None = None
    stream: bool = False
    rid: str | list[str] | None = Field(default=None, description="ignored; ids are assigned")

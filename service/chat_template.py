"""Chat messages to a prompt, with the model's own chat template.

The template is ``chat_template`` of the checkpoint's ``tokenizer_config.json`` (a string, or a
list of named templates of which "default" is taken), rendered as Hugging Face renders it: a
sandboxed Jinja environment (templates come with checkpoints, so they must not reach Python
objects), ``trim_blocks`` and ``lstrip_blocks``, ``raise_exception`` and ``tojson`` available,
``add_generation_prompt`` true. No torch import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from service.errors import CheckpointError, RequestError


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str = ""
    eos_token: str = ""

    def render(self, messages: list[dict]) -> str:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise RequestError(f"the chat template refused the messages: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, indent=indent)
        try:
            return env.from_string(self.source).render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as exc:
            raise RequestError(f"the chat template failed on these messages: {exc}") from None


def load_chat_template(model_dir: Path) -> ChatTemplate | None:
    path = model_dir / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    source = cfg.get("chat_template")
    if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default") or next(iter(named.values()), None)
    if not isinstance(source, str) or not source:
        return None

    def token(name: str) -> str:
        value = cfg.get(name) or ""
        return value.get("content", "") if isinstance(value, dict) else str(value)

    return ChatTemplate(source, token("bos_token"), token("eos_token"))

"""Text <-> token ids through the `tokenizers` library, when the checkpoint ships tokenizer.json."""

from __future__ import annotations

from pathlib import Path


class TextTokenizer:
    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(model_dir: Path) -> TextTokenizer | None:
    path = model_dir / "tokenizer.json"
    return TextTokenizer(path) if path.is_file() else None

"""Text <-> token ids through the `tokenizers` library, when the checkpoint ships tokenizer.json."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


class TextTokenizer:
    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))
        # the longest vocabulary entry, in characters: no token covers more of a text (byte-level
        # entries are at least as long as the text they stand for)
        self.max_token_chars = max((len(t) for t in self._tok.get_vocab()), default=1)

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the interpreter lock while the Rust tokenizer works (encode
        # holds it): a long text then never stalls the server's other threads
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens of ``text``, without tokenizing it (half the exact bound,
        for normalizers that change the length)."""
        return len(text) // (2 * self.max_token_chars)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(model_dir: Path) -> TextTokenizer | None:
    path = model_dir / "tokenizer.json"
    return TextTokenizer(path) if path.is_file() else None


class IncrementalDetokenizer:
    """The text of a growing output, decoding a bounded window per step, not the whole output.

    Keeps two offsets into the token list (as vLLM does): ``prefix`` where the last emitted text
    started and ``read`` where it ended. Each step decodes ``ids[prefix:]`` and emits what it adds
    to ``ids[prefix:read]``; a trailing U+FFFD (a multi-byte character cut in half) waits for the
    next token. Byte-level tokenizers make the window a few tokens long.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self.prefix = 0
        self.read = 0
        self.text = ""

    def push(self, ids: list[int]) -> str:
        """``ids``: the whole output so far. Returns the text it adds (maybe empty)."""
        prefix_text = self._decode(ids[self.prefix : self.read])
        new_text = self._decode(ids[self.prefix :])
        if new_text.endswith("\ufffd") or len(new_text) <= len(prefix_text):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix, self.read = self.read, len(ids)
        self.text += delta
        return delta

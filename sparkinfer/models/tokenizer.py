"""The checkpoint's tokenizer: transformers' AutoTokenizer when it loads, else the
`tokenizers` file (tokenizer.json) alone."""

from __future__ import annotations

from pathlib import Path

from sparkinfer.errors import CheckpointError

__all__ = ["load_tokenizer"]


class _Plain:
    def __init__(self, tok):
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def load_tokenizer(path):
    """An object with encode(text) -> ids and decode(ids) -> text, from the checkpoint
    directory. Raises CheckpointError when the directory has no tokenizer."""
    path = Path(path)
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path))

        class _HF:
            def encode(self, text: str) -> list[int]:
                # not verbose: a prompt past model_max_length is refused in one line by
                # models.validate (max_position_embeddings), not warned about here
                return tok.encode(text, verbose=False)

            def decode(self, ids: list[int]) -> str:
                return tok.decode(ids, skip_special_tokens=True)
        return _HF()
    except Exception:  # noqa: BLE001 - any failure falls back to the tokenizer file itself
        pass
    f = path / "tokenizer.json"
    if not f.exists():
        raise CheckpointError(f"{path} has no tokenizer (no tokenizer.json, and transformers could not load one); "
                              "pass token ids, or copy the model's tokenizer files into the directory")
    from tokenizers import Tokenizer

    return _Plain(Tokenizer.from_file(str(f)))

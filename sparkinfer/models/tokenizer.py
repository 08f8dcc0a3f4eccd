"""The checkpoint's tokenizer: transformers' AutoTokenizer when it loads, else the
`tokenizers` file (tokenizer.json) alone.

    tok = load_tokenizer("ckpt/")
    tok.encode("hi"); tok.decode([104, 105])
    tok.apply_chat_template([{"role": "user", "content": "hi"}])   # ids, ending in the assistant's turn

A checkpoint without a chat template (or a tokenizer.json alone) raises
ChatTemplateError from apply_chat_template, as does a template that rejects the
messages (roles out of order, say)."""

from __future__ import annotations

from pathlib import Path

from sparkinfer.errors import CheckpointError

__all__ = ["load_tokenizer", "ChatTemplateError"]


class ChatTemplateError(CheckpointError):
    """The checkpoint has no chat template, or its template rejected the messages."""


class _Plain:
    def __init__(self, tok):
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        raise ChatTemplateError("this checkpoint's tokenizer has no chat template (only tokenizer.json loaded): "
                                "send a prompt to /v1/completions instead")


def load_tokenizer(path):
    """An object with encode(text) -> ids, decode(ids) -> text and
    apply_chat_template(messages) -> ids, from the checkpoint directory. Raises
    CheckpointError when the directory has no tokenizer."""
    path = Path(path)
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path))
        # a fast tokenizer's Rust backend decodes in 1.7 us where transformers' wrapper takes
        # 6.1 (6 tokens, this repo's byte tokenizer): the serving loop decodes every request
        # at every step. The wrapper's only extra, clean_up_tokenization_spaces, keeps it.
        backend = getattr(tok, "_tokenizer", None)
        fast = backend is not None and not getattr(tok, "clean_up_tokenization_spaces", False)

        class _HF:
            def encode(self, text: str) -> list[int]:
                # not verbose: a prompt past model_max_length is refused in one line by
                # models.validate (max_position_embeddings), not warned about here
                return tok.encode(text, verbose=False)

            def decode(self, ids: list[int]) -> str:
                if fast:
                    return backend.decode(ids, skip_special_tokens=True)
                return tok.decode(ids, skip_special_tokens=True)

            def apply_chat_template(self, messages: list[dict]) -> list[int]:
                return _chat_ids(tok, path, messages)
        return _HF()
    except Exception:  # noqa: BLE001 - any failure falls back to the tokenizer file itself
        pass
    f = path / "tokenizer.json"
    if not f.exists():
        raise CheckpointError(f"{path} has no tokenizer (no tokenizer.json, and transformers could not load one); "
                              "pass token ids, or copy the model's tokenizer files into the directory")
    from tokenizers import Tokenizer

    return _Plain(Tokenizer.from_file(str(f)))


def _chat_ids(tok, path: Path, messages: list[dict]) -> list[int]:
    """transformers' apply_chat_template with the assistant's turn opened, as ids."""
    if not getattr(tok, "chat_template", None):
        raise ChatTemplateError(f"{path.name} has no chat template (tokenizer_config.json has no chat_template): "
                                "send a prompt to /v1/completions instead")
    try:
        return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    except Exception as e:  # noqa: BLE001 - jinja's TemplateError and the template's own raise_exception
        raise ChatTemplateError(f"{path.name}'s chat template rejected the messages: {type(e).__name__}: {e}") from None

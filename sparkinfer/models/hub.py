"""A checkpoint argument (`--model`, `--draft`): a local directory, or a Hugging Face
Hub model id (`org/name`, or `org/name@revision`) that this process fetches once,
before any rank starts, into the Hub's cache.

The fetch goes through `huggingface_hub` (a dependency of transformers): its cache,
its progress bars, its token (`HF_TOKEN` or `hf auth login`), its offline switch
(`HF_HUB_OFFLINE=1`: an id resolves from the cache alone) and its mirrors
(`HF_ENDPOINT`). Only the files a rank reads are fetched, as `models.checkpoint` finds
them: first the config, tokenizer and safetensors index (`META`), then the files the
index names (or, without an index, the top folder's `*.safetensors`), all at the
commit the first fetch resolved. A repository that also carries `.bin`, GGUF or
consolidated copies of its weights costs their bytes once, not twice. The ranks get
the snapshot directory, so every later step reads a local checkpoint.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from sparkinfer.errors import ModelFetchError, UnsupportedModelError
from sparkinfer.models.checkpoint import INDEX

__all__ = ["META", "ModelRef", "resolve_model"]

# the config, the safetensors index, the tokenizer in any of its forms, the chat template
META = ("config.json", "generation_config.json", "hf_quant_config.json", INDEX, "tokenizer.json",
        "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json",
        "merges.txt", "chat_template.jinja", "chat_template.json")
# the Hub's id grammar (owner/name of letters, digits, '-', '_', '.'), an optional @revision
_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w./-]+))?$")


@dataclass(frozen=True)
class ModelRef:
    """Where a checkpoint argument points. path: a local directory. repo_id /
    revision: the Hub id and revision it was fetched as (None: a directory given as such)."""

    path: str
    repo_id: str | None = None
    revision: str | None = None


def resolve_model(ref: str, *, what: str = "--model") -> ModelRef:
    """`ref` as a local checkpoint directory: an existing path as it is, else a Hub
    id fetched (or found in the cache). Raises UnsupportedModelError for a path that
    does not exist and is no Hub id, ModelFetchError (saying what to do) for an id that
    cannot be had: unknown, gated, private, or offline and not cached."""
    path = Path(ref).expanduser()
    if path.exists():
        return ModelRef(str(path))
    m = _ID.match(ref)
    if m is None or ref.startswith(("/", ".", "~")):
        raise UnsupportedModelError(f"{what} {ref} does not exist; pass a Hugging Face checkpoint directory "
                                    "(config.json, *.safetensors, tokenizer files) or a Hub model id (org/name)")
    repo, rev = m.group("repo"), m.group("rev")
    return ModelRef(_fetch(repo, rev, what), repo, rev)


def _fetch(repo: str, rev: str | None, what: str) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    name = repo + (f"@{rev}" if rev else "")
    try:
        snap = Path(snapshot_download(repo, revision=rev, allow_patterns=list(META)))
        weights = {"allow_patterns": ["*.safetensors"], "ignore_patterns": ["*/*"]}  # the top folder's
        if (snap / INDEX).is_file():
            weights = {"allow_patterns": sorted(set(json.loads((snap / INDEX).read_text())["weight_map"].values()))}
        # the commit the first fetch resolved (its snapshot folder's name), not `rev` again
        return str(snapshot_download(repo, revision=snap.name, **weights))
    except GatedRepoError:  # before RepositoryNotFoundError, its base class
        raise ModelFetchError(f"{what} {name}: the repository is gated; accept its terms on huggingface.co and "
                              "set HF_TOKEN (or run `hf auth login`)") from None
    except RepositoryNotFoundError:
        raise ModelFetchError(f"{what} {name}: no such directory here, and no such model on the Hub (or a private "
                              "one: set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ModelFetchError(f"{what} {name}: the repository has no revision {rev or 'main'!r}") from None
    except LocalEntryNotFoundError:
        raise ModelFetchError(f"{what} {name} is not in the Hugging Face cache and the Hub cannot be reached "
                              "(no network, or HF_HUB_OFFLINE=1): fetch it where there is a network "
                              "(`hf download`), or pass a local checkpoint directory") from None
    except (HfHubHTTPError, OSError, ValueError, KeyError) as exc:  # ValueError: a broken index
        raise ModelFetchError(f"{what} {name}: fetching from the Hub failed ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else 'no message'})") from None

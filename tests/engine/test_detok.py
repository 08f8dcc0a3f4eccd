"""Incremental text and stop strings on the tiny checkpoints' byte-level tokenizer
(ids 0..255 are bytes), fed one token at a time and in uneven groups."""

import pytest

from sparkinfer.engine.detok import TextStream
from sparkinfer.models.presets import _write_tokenizer
from sparkinfer.models.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    _write_tokenizer(path, 64)  # the tiny checkpoints' tokenizer files alone
    return load_tokenizer(path)


def _feed(tok, text: str, stop=(), groups=(1,)):
    ids = list(text.encode())
    s = TextStream(tok, list(b"prompt "), stop)
    shown, i, g = [], 0, 0
    while i < len(ids):
        n = groups[g % len(groups)]
        g += 1
        part = ids[i:i + n]
        i += n
        delta, stopped = s.push(part, final=i >= len(ids))
        shown.append(delta)
        if stopped:
            return "".join(shown), True, shown
    return "".join(shown), False, shown


@pytest.mark.parametrize("groups", [(1,), (2, 3), (7,)])
def test_text_grows_to_the_whole_output(tok, groups):
    text = "héllo wörld, ünïcode ✓ and 🙂 emoji"
    out, stopped, parts = _feed(tok, text, groups=groups)
    assert out == text and not stopped
    assert all("\ufffd" not in p for p in parts), "a half character was shown"


@pytest.mark.parametrize("groups", [(1,), (3,), (50,)])
def test_stop_string_cuts_the_text_and_holds_back_its_prefix(tok, groups):
    text = "one two ##x three ## four ### five"
    out, stopped, parts = _feed(tok, text, stop=("###", "zz"), groups=groups)
    assert stopped and out == "one two ##x three ## four "
    # "##" was held back while it could begin "###", then shown once it could not
    assert "".join(parts[:-1]) in out and not any(p.endswith("#") and "x" not in p for p in parts[:1])


def test_earliest_of_several_stop_strings(tok):
    out, stopped, _ = _feed(tok, "abc END1 def END2", stop=("END2", "END1"))
    assert stopped and out == "abc "


def test_no_stop_final_flushes_a_held_prefix(tok):
    out, stopped, _ = _feed(tok, "tail #", stop=("##",))
    assert not stopped and out == "tail #"


def test_streams_sharing_one_token_texts_show_what_each_alone_shows(tok):
    """The engine's streams share `singles` (each token's text alone): one decode a token a
    step instead of two, the same text, multi-byte characters and stop strings included."""
    text = "añb ✓ c🙂d ## e ### f"
    ids = list(text.encode())
    singles: dict = {}
    shared = [TextStream(tok, list(b"p "), stop, singles) for stop in ((), ("###",))]
    alone = [TextStream(tok, list(b"p "), stop) for stop in ((), ("###",))]
    for i, t in enumerate(ids):
        final = i == len(ids) - 1
        assert [s.push([t], final) for s in shared] == [s.push([t], final) for s in alone]
    assert singles and all(tok.decode([t]) == s for t, s in singles.items())

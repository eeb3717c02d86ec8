"""TextPrinter: what it writes, token by token, adds up to the reply's decoded text."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deskfleet.controller.text_printer import TextPrinter
from deskfleet.controller.tokenizer import ModelTokenizer

DEMO_MODEL = Path(__file__).resolve().parents[2] / "assets" / "models" / "target"


@pytest.fixture(scope="module")
def demo_tokenizer() -> ModelTokenizer:
    return ModelTokenizer(DEMO_MODEL)


class CountingTokenizer:
    """The demo tokenizer, counting how many tokens each decode call is given."""

    def __init__(self, tokenizer: ModelTokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoded = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens)


def printed(tokenizer: ModelTokenizer, ids: list[int], writes: list[str] | None = None) -> str:
    out = io.StringIO()
    printer = TextPrinter(tokenizer, out)
    for token in ids:
        before = out.tell()
        printer.push(0, token)
        if writes is not None and out.tell() > before:
            writes.append(out.getvalue()[before:])
    printer.finish()
    return out.getvalue()


def test_a_code_reply_is_written_whole_and_as_it_comes(demo_tokenizer: ModelTokenizer) -> None:
    text = 'def größe(n):\n    """Die Größe — ½ × n²."""\n    return n * 0.5  # 🙂 done\n'
    ids = demo_tokenizer.encode(text)
    writes: list[str] = []
    assert printed(demo_tokenizer, ids, writes) == demo_tokenizer.decode(ids) == text
    assert len(writes) > len(ids) // 2  # streamed, not held to the end
    assert all("\ufffd" not in write for write in writes)  # multi-byte characters are written whole


def test_a_reply_cut_inside_a_character_ends_with_its_replacement(demo_tokenizer: ModelTokenizer) -> None:
    ids = demo_tokenizer.encode("ok 🙂🙂🙂")
    for cut in range(1, len(ids) + 1):
        assert printed(demo_tokenizer, ids[:cut]) == demo_tokenizer.decode(ids[:cut])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 8191), max_size=60))
def test_any_token_sequence_prints_its_decoded_text(demo_tokenizer: ModelTokenizer, ids: list[int]) -> None:
    assert printed(demo_tokenizer, ids) == demo_tokenizer.decode(ids)


def test_each_token_decodes_a_short_window_not_the_whole_reply(demo_tokenizer: ModelTokenizer) -> None:
    counting = CountingTokenizer(demo_tokenizer)
    ids = demo_tokenizer.encode("    total = total + value  # keep a running sum\n" * 60)
    assert printed(counting, ids) == demo_tokenizer.decode(ids)  # type: ignore[arg-type]
    assert counting.decoded < 8 * len(ids)  # the whole tail each time: len(ids)**2 / 2


class StalledTerminal(io.StringIO):
    """A terminal whose first flush blocks until Ctrl-C: the text written stays in its buffer, shown later."""

    def __init__(self) -> None:
        super().__init__()
        self.stalled = True

    def flush(self) -> None:
        if self.stalled:
            self.stalled = False
            raise KeyboardInterrupt


def test_ctrl_c_during_a_blocked_flush_shows_the_text_once(demo_tokenizer: ModelTokenizer) -> None:
    ids = demo_tokenizer.encode("def f(x):\n    return x + 1\n")
    out = StalledTerminal()
    printer = TextPrinter(demo_tokenizer, out)
    with pytest.raises(KeyboardInterrupt):
        for token in ids:
            printer.push(0, token)
    printer.finish()  # what the chat does after Ctrl-C stops a reply
    assert out.getvalue() == demo_tokenizer.decode(printer.tokens)

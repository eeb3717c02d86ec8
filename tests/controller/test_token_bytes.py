"""controller/token_bytes: each token's own bytes (ByteLevel, ByteFallback and SentencePiece decoders, added tokens),
which joined give the text back, and a token's text with the bytes that are not UTF-8 alone escaped: the API showed
every token holding part of a character as U+FFFD, with U+FFFD's bytes."""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers

from deskfleet.controller.token_bytes import TokenBytes, byte_level_table, token_text
from deskfleet.controller.tokenizer import ModelTokenizer


def test_the_byte_level_table_covers_every_byte_once() -> None:
    table = byte_level_table()
    assert sorted(table.values()) == list(range(256)) and len(table) == 256
    assert table["Ġ"] == 0x20 and table["Ã"] == 0xC3 and table["a"] == 0x61 and table["Ċ"] == 0x0A


def test_a_byte_level_tokenizers_tokens_join_to_the_text(tiny_export: Path) -> None:
    tokenizer = ModelTokenizer(tiny_export)
    text = "こんにちは, naïve café 😀\n\tdef f(x):"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.token_bytes(token) for token in ids]
    assert b"".join(pieces).decode() == text
    assert any(len(piece) == 1 and piece[0] >= 0x80 for piece in pieces), "no token holds part of a character"
    generator = random.Random(5)
    added = {token for token in range(tokenizer.vocab_size)
             if tokenizer.decode([token], skip_special_tokens=True) == "" != tokenizer.decode([token], False)}
    assert added, "no added token found: the test's filter is not what it says"
    for _ in range(200):  # any run of plain tokens: their bytes decode (replacing what is cut) as the tokenizer does
        run = [token for token in (generator.randrange(tokenizer.vocab_size) for _ in range(6)) if token not in added]
        assert b"".join(map(tokenizer.token_bytes, run)).decode("utf-8", "replace") == \
            tokenizer.decode(run, skip_special_tokens=False)


def test_an_added_token_is_its_text(tiny_export: Path) -> None:
    tokenizer = ModelTokenizer(tiny_export)
    assert tokenizer.bos_token is not None
    bos = tokenizer.encode(tokenizer.bos_token, add_special_tokens=False)
    assert len(bos) == 1 and tokenizer.token_bytes(bos[0]) == tokenizer.bos_token.encode()


def _sentencepiece() -> Tokenizer:
    """Llama 2's shape: `▁` for a space, byte fallback tokens <0xNN>, and a decoder that strips the first space."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{byte:02X}>": 3 + byte for byte in range(256)}}
    for piece in ("▁", "a", "b", "▁a", "▁ab"):
        vocab[piece] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a"), ("▁a", "b")], unk_token="<unk>",
                                     byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    return tokenizer


def test_a_sentencepiece_tokenizers_bytes_keep_the_space_and_the_fallback_bytes() -> None:
    import json

    tokenizer = _sentencepiece()
    assert tokenizer.decoder is not None
    of = TokenBytes(json.loads(tokenizer.decoder.__getstate__()), tokenizer.id_to_token,
                    lambda token: tokenizer.decode([token]), {})
    ids = tokenizer.encode("ab a 你").ids
    assert [of(token) for token in ids] == [b" ab", b" a", b" ", b"\xe4", b"\xbd", b"\xa0"]
    assert tokenizer.decode([ids[0]]) == "ab"  # decoded alone, the space is stripped: the bytes keep it
    assert b"".join(of(token) for token in ids).decode() == " " + tokenizer.decode(ids)


def test_a_token_of_another_decoder_is_its_text_alone() -> None:
    of = TokenBytes({"type": "WordPiece", "prefix": "##"}, lambda token: "##ing", lambda token: "ing", {})
    assert of(7) == b"ing"
    assert TokenBytes(None, lambda token: None, lambda token: "", {})(10 ** 6) == b""  # outside the vocabulary


def test_a_tokens_text_escapes_only_the_bytes_that_are_not_utf8() -> None:
    assert token_text(b"\xc3") == "\\xc3"
    assert token_text(b" \xf0\x9f") == " \\xf0\\x9f"
    assert token_text("é".encode()) == "é" and token_text(b" and") == " and"

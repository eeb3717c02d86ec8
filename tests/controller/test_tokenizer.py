"""The tokenizer and chat template match transformers' own, without transformers at run time."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from deskfleet.controller.tokenizer import ChatMessage, ChatTemplateError, ModelTokenizer, NotUtf8Error, check_utf8


def test_encoding_and_chat_template_match_transformers(tiny_export: Path) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(tiny_export)
    ours = ModelTokenizer(tiny_export)
    text = "def add(a, b):\n    return a + b  # ünïcode"
    assert ours.encode(text) == reference(text)["input_ids"]
    assert ours.decode(ours.encode(text)) == text
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi there")]
    expected = reference.apply_chat_template([{"role": m.role, "content": m.content} for m in messages],
                                             add_generation_prompt=True, tokenize=False)
    assert ours.render_chat(messages) == expected
    assert ours.encode_chat(messages) == reference(expected, add_special_tokens=False)["input_ids"]


def test_missing_template_is_a_clear_error(tiny_export: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((tiny_export / "tokenizer.json").read_bytes())
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ModelTokenizer(tmp_path).render_chat([ChatMessage("user", "hi")])
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        ModelTokenizer(tmp_path / "nothing")


def test_broken_tokenizer_files_are_named(tiny_export: Path, tmp_path: Path) -> None:
    tokenizer_json = tmp_path / "tokenizer.json"
    tokenizer_json.write_text((tiny_export / "tokenizer.json").read_text()[:200])  # cut short
    with pytest.raises(ValueError, match=f"{re.escape(str(tokenizer_json))} is not a valid tokenizer file"):
        ModelTokenizer(tmp_path)
    tokenizer_json.write_bytes((tiny_export / "tokenizer.json").read_bytes())
    config = tmp_path / "tokenizer_config.json"
    for content, message in [("{not json", "is not valid JSON"), ("[1]", "must hold a JSON object")]:
        config.write_text(content)
        with pytest.raises(ValueError, match=f"{re.escape(str(config))} {message}"):
            ModelTokenizer(tmp_path)


def test_text_that_is_not_utf8_is_refused_by_name(tiny_export: Path) -> None:
    tokenizer = ModelTokenizer(tiny_export)
    with pytest.raises(NotUtf8Error, match=r"the text is not valid UTF-8 text \(byte 0xff at character 2\)"):
        tokenizer.encode("ab\udcffc")  # what surrogateescape makes of the byte 0xff
    with pytest.raises(NotUtf8Error, match="--system is not valid UTF-8"):
        check_utf8("\ud800", "--system")
    check_utf8("ünïcode ✓", "--prompt 1")


def test_a_model_folder_cannot_link_its_tokenizer_files_to_files_elsewhere(tiny_export: Path, tmp_path: Path) -> None:
    # A chat_template.jinja linked to a secret file made its text the prompt (and, with --fleet, sent it on).
    from deskfleet.common.model_spec import ManifestError

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((tiny_export / "tokenizer.json").read_bytes())
    secret = tmp_path / "secret.txt"
    secret.write_text("API-KEY=sk-12345")
    (folder / "chat_template.jinja").symlink_to(secret)
    with pytest.raises(ManifestError, match=r"chat_template\.jinja is a symbolic link"):
        ModelTokenizer(folder)


@pytest.mark.parametrize(("template", "message"), [
    ("{{ 1/0 }}", "ZeroDivisionError"), ("{{ 1 + 'a' }}", "TypeError"), ("{% include 'x' %}", "no loader"),
    ("{{ raise_exception('roles must alternate') }}", "the chat template refused the conversation: roles must "
                                                      "alternate"),
    ("{{ broken", "the chat template failed: TemplateSyntaxError"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}xxxx{% endfor %}{% endfor %}", "renders more than"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
    # what fills the memory before anything is written: refused by the child's memory cap
    ("{{ 'a' * 4000000000 }}", "GiB"), ("{{ '%4000000000d' % 1 }}", "GiB"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     "GiB"),
])
def test_a_chat_template_from_elsewhere_fails_by_name_not_by_traceback_or_memory(
        tiny_export: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, template: str, message: str) -> None:
    from deskfleet.controller import chat_template

    if message == "GiB":
        # Filling 2 GiB takes 2 s here but took more than the 10 s time limit on a CI machine with slow page
        # faults, where the template was refused for its time instead: these cases check the memory cap.
        monkeypatch.setattr(chat_template, "RENDER_TIMEOUT_S", 120.0)
    (tmp_path / "tokenizer.json").write_bytes((tiny_export / "tokenizer.json").read_bytes())
    (tmp_path / "chat_template.jinja").write_text(template)
    # the file to fix comes first ("TemplateSyntaxError: ..." alone named none), but for the template's own words
    source = "" if "refused" in message else re.escape(f"{tmp_path / 'chat_template.jinja'}: ") + ".*"
    with pytest.raises(ChatTemplateError, match=f"^{source}" + re.escape(message)):
        ModelTokenizer(tmp_path).render_chat([ChatMessage("user", "hi")])


def test_transformers_list_of_named_templates_uses_the_default(tiny_export: Path, tmp_path: Path) -> None:
    import json

    (tmp_path / "tokenizer.json").write_bytes((tiny_export / "tokenizer.json").read_bytes())
    config = tmp_path / "tokenizer_config.json"
    templates = [{"name": "tool_use", "template": "tools"},
                 {"name": "default", "template": "{{ messages[0].content }}"}]
    config.write_text(json.dumps({"chat_template": templates}))
    assert ModelTokenizer(tmp_path).render_chat([ChatMessage("user", "hi")]) == "hi"
    for value in ([{"name": "tool_use", "template": "tools"}], 7):
        config.write_text(json.dumps({"chat_template": value}))
        with pytest.raises(ChatTemplateError, match=f"{re.escape(str(config))}: chat_template"):
            ModelTokenizer(tmp_path)


def test_an_exports_tokenizer_files_are_checked_against_its_manifest(tiny_export: Path, tmp_path: Path) -> None:
    # only the IR files were: without tokenizer_config.json the template lost its BOS and end tokens, unsaid
    import shutil

    from deskfleet.common.model_spec import ManifestError

    model = tmp_path / "model"
    shutil.copytree(tiny_export, model)
    config = (model / "tokenizer_config.json").read_text()
    (model / "tokenizer_config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"tokenizer_config.json is missing, though the export's manifest"):
        ModelTokenizer(model)
    (model / "tokenizer_config.json").write_text(config.replace("}", ', "x": 1}', 1))
    with pytest.raises(ManifestError, match=r"tokenizer_config.json has \d+ bytes, the manifest says \d+: export"):
        ModelTokenizer(model)
    (model / "tokenizer_config.json").write_text(config)
    (model / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")  # a template's fix: allowed
    assert ModelTokenizer(model).chat_template == "{{ messages[0]['content'] }}"


def test_a_long_text_is_encoded_without_holding_the_other_threads(tiny_export: Path) -> None:
    # tokenizers' encode held the GIL for a whole text: `serve` tokenizes completion prompts in a worker thread, and a
    # 266,000-character prompt still held its event loop, every client's stream, 0.2 s
    import asyncio
    import time

    tokenizer = ModelTokenizer(tiny_export)
    text = "def f(x):\n    return x + 1  # a comment\n" * 8000

    async def widest_gap() -> tuple[float, float]:
        widest, done = 0.0, False

        async def tick() -> None:
            nonlocal widest
            last = time.perf_counter()
            while not done:
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                widest, last = max(widest, now - last), now

        ticking = asyncio.create_task(tick())
        await asyncio.sleep(0.02)
        started = time.perf_counter()
        ids = await asyncio.to_thread(tokenizer.encode, text)
        took = time.perf_counter() - started
        done = True
        await ticking
        assert len(ids) > 10_000
        return took, widest

    took, widest = asyncio.run(widest_gap())
    assert widest < took / 2, (took, widest)

"""Named chat templates (tokenizer_config.json's list, or chat_template.jinja with additional_chat_templates/):
transformers saved all but "default" into a subfolder of the export, whose hashing then failed with
IsADirectoryError (a traceback, no export). The export keeps the default template, which chat renders as
transformers does."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from deskfleet.common.model_spec import WeightFormat, load_manifest, verify_files
from deskfleet.controller.export.exporter import export_checkpoint
from deskfleet.controller.tokenizer import ChatMessage, ModelTokenizer

TOOL_TEMPLATE = "TOOLS {% for message in messages %}{{ message['content'] }}{% endfor %}"


def with_named_templates(source: Path, tmp_path: Path, layout: str) -> Path:
    checkpoint = tmp_path / f"named-{layout}"
    shutil.copytree(source, checkpoint)
    default = (checkpoint / "chat_template.jinja").read_text(encoding="utf-8")
    if layout == "config-list":
        (checkpoint / "chat_template.jinja").unlink()
        config_path = checkpoint / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config["chat_template"] = [{"name": "default", "template": default},
                                   {"name": "tool_use", "template": TOOL_TEMPLATE}]
        config_path.write_text(json.dumps(config), encoding="utf-8")
    else:
        (checkpoint / "additional_chat_templates").mkdir()
        (checkpoint / "additional_chat_templates" / "tool_use.jinja").write_text(TOOL_TEMPLATE, encoding="utf-8")
    return checkpoint


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]


@pytest.mark.parametrize("layout", ["config-list", "jinja-files"])
def test_named_chat_templates_export_with_the_default_one(checkpoint_factory: Callable[..., Path], tmp_path: Path,
                                                          layout: str, caplog: pytest.LogCaptureFixture) -> None:
    from transformers import AutoTokenizer

    checkpoint = with_named_templates(checkpoint_factory("review-named-templates", num_hidden_layers=1), tmp_path,
                                      layout)
    export = tmp_path / "export"
    with caplog.at_level(logging.WARNING):
        export_checkpoint(checkpoint, export, WeightFormat.F32)
    # the templates left out are named at the default log level (an info line said it, unseen)
    assert [text for text in warnings_of(caplog) if "chat templates" in text] == [
        f'the tokenizer of {checkpoint} has named chat templates: the export keeps only "default" (the one '
        "`generate --chat` and `chat` render) and leaves out tool_use"]
    verify_files(export, load_manifest(export))
    assert all(path.is_file() for path in export.iterdir())
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi there")]
    expected = AutoTokenizer.from_pretrained(checkpoint).apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages], tokenize=False, add_generation_prompt=True)
    assert ModelTokenizer(export).render_chat(messages) == expected


def test_named_chat_templates_without_a_default_one_are_named_in_a_warning(
        checkpoint_factory: Callable[..., Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # none named "default": the export had no chat template, said only at INFO; `generate --chat` found out later
    checkpoint = with_named_templates(checkpoint_factory("review-named-templates", num_hidden_layers=1), tmp_path,
                                      "config-list")
    config_path = checkpoint / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = [{"name": "tool_use", "template": TOOL_TEMPLATE},
                               {"name": "rag", "template": TOOL_TEMPLATE}]
    config_path.write_text(json.dumps(config), encoding="utf-8")
    export = tmp_path / "export"
    with caplog.at_level(logging.WARNING):
        export_checkpoint(checkpoint, export, WeightFormat.F32)
    (warned,) = [text for text in warnings_of(caplog) if "chat templates" in text]
    assert warned.startswith(f'the tokenizer of {checkpoint} has named chat templates (tool_use, rag) but none named '
                             '"default", the only one an export keeps: the export has no chat template'), warned
    assert not ModelTokenizer(export).chat_template


def test_a_chat_template_that_is_no_jinja_template_is_warned_of_at_export(
        checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:
    # it exported without a word; only `generate --chat`, later, failed with TemplateSyntaxError
    from tests.log_records import records_of

    checkpoint = tmp_path / "broken-template"
    shutil.copytree(checkpoint_factory("review-named-templates", num_hidden_layers=1), checkpoint)
    (checkpoint / "chat_template.jinja").write_text("{% for %}{{ message }}", encoding="utf-8")
    with records_of("deskfleet.controller.export", logging.WARNING) as logged:
        export_checkpoint(checkpoint, tmp_path / "export", WeightFormat.F32)
    (warned,) = [message for message in logged.messages() if "chat template" in message]
    assert warned.startswith(f"the chat template of {checkpoint} is not a valid Jinja template (")
    assert "line 1): `generate --chat`, `chat` and chat requests to `serve` will refuse it" in warned
    assert (tmp_path / "export" / "manifest.json").is_file()  # plain completion still works: exported

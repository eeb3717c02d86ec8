"""Named chat templates (tokenizer_config.json's list, or chat_template.jinja with additional_chat_templates/):
transformers saved all but "default" into a subfolder of the export, whose hashing then failed with
IsADirectoryError (a traceback, no export). The export keeps the default template, which chat renders as
transformers does."""

from __future__ import annotations

import json
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


@pytest.mark.parametrize("layout", ["config-list", "jinja-files"])
def test_named_chat_templates_export_with_the_default_one(checkpoint_factory: Callable[..., Path], tmp_path: Path,
                                                          layout: str) -> None:
    from transformers import AutoTokenizer

    checkpoint = with_named_templates(checkpoint_factory("review-named-templates", num_hidden_layers=1), tmp_path,
                                      layout)
    export = tmp_path / "export"
    export_checkpoint(checkpoint, export, WeightFormat.F32)
    verify_files(export, load_manifest(export))
    assert all(path.is_file() for path in export.iterdir())
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi there")]
    expected = AutoTokenizer.from_pretrained(checkpoint).apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages], tokenize=False, add_generation_prompt=True)
    assert ModelTokenizer(export).render_chat(messages) == expected

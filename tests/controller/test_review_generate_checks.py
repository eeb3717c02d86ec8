"""`deskfleet generate` refuses a draft model that cannot draft for the target, and more stages than the
target has layers, before any model compiles (both were refused only after compiling the draft model,
the draft's mismatch even after compiling the target's stages too)."""

from __future__ import annotations

import io
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.common.model_spec import load_manifest
from deskfleet.controller import draft as draft_module
from deskfleet.controller import pipeline as pipeline_module
from deskfleet.controller.chat import ChatOptions, run_chat
from deskfleet.controller.export.random_checkpoint import CHAT_TEMPLATE
from deskfleet.controller.run import GenerateOptions, run_generate

F32 = CompileSettings(precision=Precision.F32)


@pytest.fixture
def no_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any stage compiled (the target's or the draft model's) fails the test."""

    def compiled(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was compiled before the request was refused")

    monkeypatch.setattr(draft_module, "Stage", compiled)
    monkeypatch.setattr(pipeline_module, "Stage", compiled)


@pytest.mark.parametrize("prompt_lookup", [False, True])
def test_a_draft_with_another_vocabulary_is_refused_before_anything_compiles(
        tiny_export: Path, checkpoint_factory: Callable[..., Path], export_factory: Callable[[Path, str], Path],
        no_compiling: None, prompt_lookup: bool) -> None:
    other = export_factory(checkpoint_factory("review-draft-vocab", num_hidden_layers=1, vocab_size=300), "f32")
    options = GenerateOptions(model=tiny_export, prompt_ids=[[1, 5, 6]], max_new_tokens=4, draft=other,
                              prompt_lookup=prompt_lookup, settings=F32)
    with pytest.raises(ValueError, match="share a tokenizer"):
        run_generate(options)


def test_a_draft_with_a_shorter_context_is_refused_before_anything_compiles(
        tiny_export: Path, checkpoint_factory: Callable[..., Path], export_factory: Callable[[Path, str], Path],
        no_compiling: None) -> None:
    context = load_manifest(tiny_export).spec.max_context
    short = export_factory(checkpoint_factory("review-draft-short", num_hidden_layers=1,
                                              max_position_embeddings=context // 2), "f32")
    options = GenerateOptions(model=tiny_export, prompt_ids=[[1, 5, 6]], max_new_tokens=4, draft=short, settings=F32)
    with pytest.raises(ValueError, match=f"--max-context {context}"):
        run_generate(options)


def test_more_stages_than_layers_are_refused_before_the_draft_compiles(tiny_export: Path,
                                                                        no_compiling: None) -> None:
    layers = load_manifest(tiny_export).spec.num_layers
    options = GenerateOptions(model=tiny_export, prompt_ids=[[1, 5, 6]], max_new_tokens=4, stages=layers + 1,
                              draft=tiny_export, settings=F32)
    with pytest.raises(ValueError, match=f"cannot split {layers} layers into {layers + 1} stages"):
        run_generate(options)


def test_a_chat_with_a_draft_of_another_vocabulary_is_refused_before_anything_compiles(
        tmp_path: Path, tiny_export: Path, checkpoint_factory: Callable[..., Path],
        export_factory: Callable[[Path, str], Path], no_compiling: None) -> None:
    # It failed only once the first message was typed, with an error that ended the chat
    model = tmp_path / "model"
    shutil.copytree(tiny_export, model)
    (model / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    other = export_factory(checkpoint_factory("review-draft-vocab", num_hidden_layers=1, vocab_size=300), "f32")
    lines = io.StringIO("hello\n")
    with pytest.raises(ValueError, match="share a tokenizer"):
        run_chat(ChatOptions(model=model, draft=other, settings=F32), lines, io.StringIO())
    assert lines.tell() == 0  # refused before reading a message

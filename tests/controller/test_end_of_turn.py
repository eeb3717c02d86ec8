"""A chat reply ends at the template's end-of-turn token even where the generation config does not list it as
EOS (ChatML's <|im_end|>, Gemma's <end_of_turn>): the reply ran on into turns the model invented."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.common.model_spec import load_manifest
from deskfleet.controller.chat import ChatOptions, run_chat
from deskfleet.controller.engine import Engine, EngineOptions, StreamRequest
from deskfleet.controller.pipeline import LocalPipeline
from deskfleet.controller.prompt_lookup import PromptLookupDraft
from deskfleet.controller.tokenizer import ChatMessage, ModelTokenizer

F32 = CompileSettings(precision=Precision.F32)


def special_tokens(model: Path) -> dict[str, int]:
    from tokenizers import Tokenizer

    added = Tokenizer.from_file(str(model / "tokenizer.json")).get_added_tokens_decoder()
    return {token.content: token_id for token_id, token in added.items() if token.special}


def with_template(tmp_path: Path, tiny_export: Path, template: str) -> Path:
    model = tmp_path / "model"
    if not model.exists():
        shutil.copytree(tiny_export, model)
    (model / "chat_template.jinja").write_text(template)
    return model


def a_non_eos_special(model: Path) -> tuple[str, int]:
    eos = set(load_manifest(model).spec.eos_token_ids)
    return next((text, token) for text, token in sorted(special_tokens(model).items()) if token not in eos)


def test_the_token_the_template_writes_after_a_reply_ends_the_turn(tiny_export: Path, tmp_path: Path) -> None:
    marker, marker_id = a_non_eos_special(tiny_export)
    chatml = ("{% for m in messages %}{{ '[' + m['role'] + ']\\n' + m['content'] + '" + marker + "\\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '[assistant]\\n' }}{% endif %}")
    assert ModelTokenizer(with_template(tmp_path, tiny_export, chatml)).end_of_turn_ids() == {marker_id}
    spaced = "{% for m in messages %}{{ m['content'] + '  \\n ' + '" + marker + "' }}{% endfor %}"  # after blanks
    assert ModelTokenizer(with_template(tmp_path, tiny_export, spaced)).end_of_turn_ids() == {marker_id}


@pytest.mark.parametrize("template", [
    "{% for m in messages %}{{ m['content'] + '\\n\\nnext: ' }}{% endfor %}",  # a turn ends with text
    "{% for m in messages %}{{ m['content'] }}{% endfor %}",  # with nothing
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ raise_exception('no replies') }}{% endif %}"
    "{{ m['content'] }}{% endfor %}",  # cannot render an exchange
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}",  # drops it
])
def test_a_template_without_an_end_of_turn_token_adds_no_stop(tiny_export: Path, tmp_path: Path,
                                                               template: str) -> None:
    assert ModelTokenizer(with_template(tmp_path, tiny_export, template)).end_of_turn_ids() == frozenset()


@pytest.mark.parametrize("drafter", [None, "lookup"])
def test_a_stop_token_ends_a_stream_as_eos_does_also_inside_an_accepted_draft(tiny_export: Path,
                                                                               drafter: str | None) -> None:
    manifest = load_manifest(tiny_export)
    prompt = [5, 9, 5, 9, 5, 9, 5, 9, 5, 9, 5]  # repetitive: prompt lookup drafts, rounds accept several tokens

    def generate(stop: frozenset[int], ignore_eos: bool = False) -> tuple[list[int], bool]:
        draft = PromptLookupDraft(min_ngram=1) if drafter else None
        engine = Engine(pipeline, manifest.spec, draft, EngineOptions(max_rows=1, micro_batches=1))
        engine.add(StreamRequest(prompt, max_new_tokens=24, ignore_eos=ignore_eos, stop_token_ids=stop))
        (result,) = engine.run().values()
        return result.tokens, result.stopped_by_eos

    with LocalPipeline(tiny_export, 1, F32, manifest) as pipeline:
        free, _ = generate(frozenset(), ignore_eos=True)
        eos = set(manifest.spec.eos_token_ids)
        index, token = next((i, t) for i, t in enumerate(free) if i >= 3 and t not in eos and t not in free[:i])
        stopped, by_stop = generate(frozenset({token}))
        assert stopped == free[:index + 1] and by_stop  # cut right after the stop token, as at EOS
        ignored, by_stop = generate(frozenset({token}), ignore_eos=True)
        assert ignored == free and not by_stop  # --ignore-eos ignores stop tokens too


def test_chat_stops_a_reply_at_the_end_of_turn(tiny_export: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    model = with_template(tmp_path, tiny_export, "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    options = ChatOptions(model=model, max_new_tokens=12, settings=F32)

    def reply(stop: frozenset[int]) -> str:
        monkeypatch.setattr(ModelTokenizer, "end_of_turn_ids", lambda self: stop)
        out = io.StringIO()
        assert run_chat(options, io.StringIO("hello there\n"), out) == 1
        return out.getvalue()

    free = reply(frozenset())
    tokenizer = ModelTokenizer(model)
    prompt = tokenizer.encode_chat([ChatMessage("user", "hello there")])
    with LocalPipeline(model, 1, F32, load_manifest(model)) as pipeline:
        engine = Engine(pipeline, load_manifest(model).spec, None, EngineOptions(max_rows=1, micro_batches=1))
        engine.add(StreamRequest(prompt, max_new_tokens=12))
        (result,) = engine.run().values()
    first = result.tokens[0]
    assert reply(frozenset({first})) == tokenizer.decode([first]) + "\n"
    assert len(free) > len(tokenizer.decode([first]) + "\n")


"""A draft model must share the target's tokenizer: one of another tokenizer with the same vocabulary size passed
the spec check, and drafted text the target never accepted (mean accepted 0.0), slower than no drafting. A few ids
renamed (a release's reserved special tokens) are warned of, not refused."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import pytest

from deskfleet.common.model_spec import FileEntry, Manifest, load_manifest, sha256_of
from deskfleet.controller.draft import MAX_DIFFERING_TOKEN_SHARE, check_draft_tokenizer, open_drafter


def _with_tokenizer(export: Path, folder: Path, rotated: int = 0, indent: int | None = None) -> tuple[Path, Manifest]:
    """A copy of `export`'s folder whose tokenizer.json gives `rotated` of its tokens each other's ids (or is only
    re-indented), its manifest listing the file as it is now."""
    shutil.copytree(export, folder)
    path = folder / "tokenizer.json"
    body = json.loads(path.read_text())
    vocabulary = body["model"]["vocab"]
    chosen = sorted(vocabulary.items(), key=lambda item: item[1])[40:40 + rotated]
    for (token, _), (_, token_id) in zip(chosen, chosen[1:] + chosen[:1], strict=True):
        vocabulary[token] = token_id
    path.write_text(json.dumps(body, indent=indent))
    listed = json.loads((folder / "manifest.json").read_text())
    listed["files"]["tokenizer.json"] = {"sha256": sha256_of(path), "size": path.stat().st_size}
    (folder / "manifest.json").write_text(json.dumps(listed))
    manifest = load_manifest(export)
    files = {**manifest.files, "tokenizer.json": FileEntry(sha256_of(path), path.stat().st_size)}
    return folder, dataclasses.replace(manifest, files=files)


def _vocabulary_size(export: Path) -> int:
    from tokenizers import Tokenizer

    return len(Tokenizer.from_file(str(export / "tokenizer.json")).get_vocab(with_added_tokens=True))


def test_the_same_tokenizer_passes_by_its_digest_or_its_vocabulary(tiny_export: Path, tmp_path: Path) -> None:
    target = load_manifest(tiny_export)
    check_draft_tokenizer(tiny_export, target, tiny_export, target)  # the same file
    reformatted, manifest = _with_tokenizer(tiny_export, tmp_path / "reformatted", indent=2)
    check_draft_tokenizer(reformatted, manifest, tiny_export, target)  # another file, the same ids


def test_a_tokenizer_giving_many_ids_to_other_tokens_is_refused_naming_one(tiny_export: Path,
                                                                             tmp_path: Path) -> None:
    size = _vocabulary_size(tiny_export)
    many = int(size * MAX_DIFFERING_TOKEN_SHARE) + 2
    other, manifest = _with_tokenizer(tiny_export, tmp_path / "other", rotated=many)
    with pytest.raises(ValueError) as refused:
        check_draft_tokenizer(other, manifest, tiny_export, load_manifest(tiny_export))
    assert str(refused.value).startswith(
        f"the draft's tokenizer is not the target's: {many:,} of the {size:,} token ids of the target's tokenizer "
        "name other tokens in the draft's (id 40: ")
    with pytest.raises(ValueError, match=f"the draft's tokenizer is not the target's: {many:,} of"):
        open_drafter(other, False, target=tiny_export)  # before it compiles
    assert open_drafter(tiny_export, False, target=tiny_export) is not None


def test_a_few_renamed_ids_are_warned_of_and_drafting_goes_on(tiny_export: Path, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    # releases of one tokenizer rename a few reserved special tokens, which ordinary text never meets
    near, manifest = _with_tokenizer(tiny_export, tmp_path / "near", rotated=2)
    with caplog.at_level(logging.WARNING, logger="deskfleet"):
        check_draft_tokenizer(near, manifest, tiny_export, load_manifest(tiny_export))
    assert "--draft: 2 of the" in caplog.text and "drafting goes on" in caplog.text


def test_an_unreadable_tokenizer_is_named(tiny_export: Path, tmp_path: Path) -> None:
    broken, manifest = _with_tokenizer(tiny_export, tmp_path / "broken", indent=2)
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"the draft's .*tokenizer.json cannot be read as a tokenizer"):
        check_draft_tokenizer(broken, manifest, tiny_export, load_manifest(tiny_export))

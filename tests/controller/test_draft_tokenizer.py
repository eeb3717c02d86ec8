"""A draft model must share the target's tokenizer: one of another tokenizer with the same vocabulary size passed
the spec check, and drafted text the target never accepted (mean accepted 0.0), slower than no drafting."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from deskfleet.common.model_spec import FileEntry, Manifest, load_manifest
from deskfleet.controller.draft import check_draft_tokenizer, open_drafter


def _with_tokenizer(export: Path, folder: Path, edit: dict[str, object] | None = None,
                    indent: int | None = None) -> tuple[Path, Manifest]:
    """A copy of `export`'s folder whose tokenizer.json is rewritten (its vocabulary edited by `edit`: token ->
    new id, or re-indented alone), and its manifest as it would then list the file."""
    shutil.copytree(export, folder)
    path = folder / "tokenizer.json"
    body = json.loads(path.read_text())
    body["model"]["vocab"].update(edit or {})
    path.write_text(json.dumps(body, indent=indent))
    manifest = load_manifest(export)
    files = {**manifest.files, "tokenizer.json": FileEntry("0" * 64, path.stat().st_size)}
    return folder, dataclasses.replace(manifest, files=files)


def test_the_same_tokenizer_passes_by_its_digest_or_its_vocabulary(tiny_export: Path, tmp_path: Path) -> None:
    target = load_manifest(tiny_export)
    check_draft_tokenizer(tiny_export, target, tiny_export, target)  # the same file
    reformatted, manifest = _with_tokenizer(tiny_export, tmp_path / "reformatted", indent=2)
    check_draft_tokenizer(reformatted, manifest, tiny_export, target)  # another file, the same ids


def test_a_tokenizer_giving_ids_to_other_tokens_is_refused_naming_one(tiny_export: Path, tmp_path: Path) -> None:
    target = load_manifest(tiny_export)
    vocabulary = json.loads((tiny_export / "tokenizer.json").read_text())["model"]["vocab"]
    (a, a_id), (b, b_id) = sorted(vocabulary.items(), key=lambda item: item[1])[40:42]
    swapped, manifest = _with_tokenizer(tiny_export, tmp_path / "swapped", {a: b_id, b: a_id})
    with pytest.raises(ValueError) as refused:
        check_draft_tokenizer(swapped, manifest, tiny_export, target)
    assert str(refused.value) == (
        f"the draft's tokenizer is not the target's: 2 of the target's {len(vocabulary):,} token ids name other "
        f"tokens (id {a_id}: {b!r} in the draft, {a!r} in the target), so the target would accept none of its "
        "proposals; give a draft model exported with the target's tokenizer")


def test_a_command_given_such_a_draft_refuses_it_before_it_compiles(tiny_export: Path, tmp_path: Path) -> None:
    vocabulary = json.loads((tiny_export / "tokenizer.json").read_text())["model"]["vocab"]
    (a, a_id), (b, b_id) = sorted(vocabulary.items(), key=lambda item: item[1])[40:42]
    swapped, _ = _with_tokenizer(tiny_export, tmp_path / "swapped", {a: b_id, b: a_id})
    manifest = json.loads((swapped / "manifest.json").read_text())  # the export as it would list that file
    from deskfleet.common.model_spec import sha256_of

    manifest["files"]["tokenizer.json"] = {"sha256": sha256_of(swapped / "tokenizer.json"),
                                           "size": (swapped / "tokenizer.json").stat().st_size}
    (swapped / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="the draft's tokenizer is not the target's: 2 of"):
        open_drafter(swapped, False, target=tiny_export)
    assert open_drafter(tiny_export, False, target=tiny_export) is not None

"""An agent handed a stage whose export contradicts its manifest (vocab_size edited: every file still matches its
checksum) refuses it as the export's fault: it took the ManifestError for a damaged shard, answered
shard_mismatch and re-hashed every file it held, the controller sent the stage again, and a failover would
have left a healthy PC out for it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from deskfleet.common.model_spec import MANIFEST_NAME
from deskfleet.common.wire import ErrorCode, Role, ShardQuery
from tests.agent.test_core import core, handle  # noqa: F401  (core: the fixture)
from tests.agent.test_review_cache_race import _push_tiny_stage


def test_an_export_whose_manifest_contradicts_its_files_is_refused_as_a_bad_message(
        core: Any, tiny_export: Path, tmp_path: Path) -> None:  # noqa: F811
    folder = tmp_path / "edited"
    shutil.copytree(tiny_export, folder)
    body = json.loads((folder / MANIFEST_NAME).read_text())
    body["spec"]["vocab_size"] -= 12
    (folder / MANIFEST_NAME).write_text(json.dumps(body))
    assignment = _push_tiny_stage(core, folder)
    with pytest.raises(Exception) as refused:
        handle(core, Role.CONTROLLER, assignment)
    assert refused.value.code is ErrorCode.BAD_MESSAGE  # type: ignore[attr-defined]
    assert "manifest.json says vocab_size" in str(refused.value)
    held = handle(core, Role.CONTROLLER, ShardQuery(tuple(entry.sha256 for entry in assignment.manifest)))
    assert len(held.complete) == len(assignment.manifest)  # nothing dropped as damaged

"""`--temperature` above what a step can carry is refused by its option name before anything compiles.

The wire's SamplingInfo takes temperatures up to 100; `generate` accepted any finite temperature, compiled
the target and then failed at the first step with "temperature 150.0 outside [0, 100]", naming no option.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deskfleet.agent import stage as stage_module
from deskfleet.common.wire import SamplingInfo
from deskfleet.controller.cli import main
from deskfleet.controller.decoding_options import MAX_TEMPERATURE, DecodingOptions


def test_the_largest_temperature_the_options_accept_is_one_a_step_carries() -> None:
    DecodingOptions(temperature=MAX_TEMPERATURE)
    SamplingInfo(temperatures=(MAX_TEMPERATURE,), top_ks=(0,), top_ps=(1.0,), seeds=(0,))
    with pytest.raises(ValueError, match="--temperature"):
        DecodingOptions(temperature=MAX_TEMPERATURE * 1.5)


def test_generate_refuses_a_temperature_above_the_bound_by_name_before_compiling(
        tiny_export: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[object] = []
    real_init = stage_module.Stage.__init__

    def recording_init(self: stage_module.Stage, *args: object, **kwargs: object) -> None:
        compiled.append(args)
        real_init(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(stage_module.Stage, "__init__", recording_init)
    code = main(["generate", "--model", str(tiny_export), "--prompt-ids", "1,2", "--temperature", "150",
                 "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "--temperature" in err, err
    assert compiled == []


def test_generate_samples_at_the_bound(tiny_export: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", "--model", str(tiny_export), "--prompt-ids", "1,2", "--temperature",
                 str(MAX_TEMPERATURE), "--seed", "3", "--max-new-tokens", "3", "--ignore-eos", "--json"])
    out = capsys.readouterr().out
    assert code == 0 and len(json.loads(out)["tokens"]) == 3

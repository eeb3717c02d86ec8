"""INT4 group size: the largest of 128/64/32 dividing every MatMul's input width; per channel, with one
warning an export, when none does (it loses more accuracy, and was silent)."""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

from deskfleet.controller.export import exporter


def layer(*widths: int) -> ov.Model:
    x = ops.parameter([1, widths[0]], np.float32)
    out = x
    for width, following in zip(widths, (*widths[1:], 16), strict=True):
        out = ops.matmul(out, ops.constant(np.zeros((following, width), np.float32)), False, True)
    return ov.Model([out], [x])


@pytest.mark.parametrize(("widths", "size"), [((256, 512), 128), ((192, 64), 64), ((96, 224), 32), ((80, 64), -1)])
def test_the_largest_group_that_divides_every_width(widths: tuple[int, ...], size: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    warnings: list[str] = []
    monkeypatch.setattr(exporter.log, "warning", lambda text, *args: warnings.append(text % args))
    exporter._warn_per_channel.cache_clear()
    assert exporter._group_size(layer(*widths)) == size
    assert exporter._group_size(layer(*widths)) == size  # a second layer of the same widths
    assert len(warnings) == (1 if size == -1 else 0)
    if warnings:
        assert "per output channel" in warnings[0] and "64, 80" in warnings[0]

import re

import pytest

from deskfleet.common.devices import VIRTUAL, device_kind, device_targets, lists_device


def test_device_kind_drops_index_and_targets() -> None:
    assert [device_kind(name) for name in ("CPU", "cpu", "CPU.0", "GPU.1", "NPU", " gpu ")] == \
        ["CPU", "CPU", "CPU", "GPU", "NPU", "GPU"]
    assert [device_kind(name) for name in ("AUTO", "HETERO:GPU,CPU", "MULTI:GPU.0,CPU")] == \
        ["AUTO", "HETERO", "MULTI"]
    assert {device_kind(name) for name in ("AUTO:CPU", "HETERO:GPU,CPU", "MULTI")} <= VIRTUAL


def test_a_device_is_listed_by_kind_by_index_or_as_the_lone_one() -> None:
    assert lists_device("GPU", ["CPU", "GPU.0", "GPU.1"]) and lists_device("GPU.1", ("CPU", "GPU.0", "GPU.1"))
    assert lists_device("GPU.0", ["CPU", "GPU"]) and not lists_device("GPU.1", ["CPU", "GPU"])
    assert not lists_device("NPU", ["CPU", "GPU"]) and lists_device("CPU", ["CPU"])
    assert not lists_device("GPU", ["CPU"]) and not lists_device("GPU", [])
    # a bare virtual device picks among what there is; one with targets needs every one of them (OpenVINO's
    # AUTO:GPU,CPU failed on a PC without a GPU driver rather than run on the CPU)
    assert lists_device("AUTO", ["CPU"]) and lists_device("MULTI", []) and lists_device("AUTO:-NPU", ["CPU"])
    assert not lists_device("AUTO:GPU,CPU", ["CPU"]) and lists_device("AUTO:GPU,CPU", ["GPU", "CPU"])
    assert not lists_device("HETERO:GPU.1,CPU", ["GPU.0", "GPU.1"]) and lists_device("HETERO:GPU.1,CPU",
                                                                                    ["CPU", "GPU.0", "GPU.1"])
    assert not lists_device("MULTI:GPU,NPU", ["CPU"]) and not lists_device("HETERO:GPU", [])
    assert not lists_device("BATCH:GPU(4)", ["CPU", "NPU"]) and lists_device("BATCH:GPU(4)", ["CPU", "GPU"])
    assert not lists_device("AUTO:GPU.1,-CPU", ["CPU", "GPU"])


def test_device_targets_lists_what_a_name_runs_on_and_refuses_what_openvino_would_not_read() -> None:
    assert device_targets("GPU.1") == ("GPU.1",) and device_targets("AUTO") == ("AUTO",)
    assert device_targets("MULTI:GPU(4),CPU(2),GPU") == ("GPU", "CPU") and device_targets("AUTO:-NPU") == ("AUTO",)
    for name in ("cpu", "GPU,CPU", "CPU:GPU", "AUTO:", "AUTO:MULTI", "X" * 33):
        with pytest.raises(ValueError, match=re.escape(repr(name))):
            device_targets(name)
    with pytest.raises(ValueError, match=re.escape("(names are upper case: AUTO:GPU,CPU)")):
        device_targets("auto:gpu,cpu")

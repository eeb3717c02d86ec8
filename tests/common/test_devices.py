from deskfleet.common.devices import VIRTUAL, device_kind


def test_device_kind_drops_index_and_targets() -> None:
    assert [device_kind(name) for name in ("CPU", "cpu", "CPU.0", "GPU.1", "NPU", " gpu ")] == \
        ["CPU", "CPU", "CPU", "GPU", "NPU", "GPU"]
    assert [device_kind(name) for name in ("AUTO", "HETERO:GPU,CPU", "MULTI:GPU.0,CPU")] == \
        ["AUTO", "HETERO", "MULTI"]
    assert {device_kind(name) for name in ("AUTO:CPU", "HETERO:GPU,CPU", "MULTI")} <= VIRTUAL

"""deskfleet.common: pure code shared by the agent and the controller."""

from deskfleet.common.no_telemetry import block_openvino_telemetry

block_openvino_telemetry()  # before any module of this package imports openvino

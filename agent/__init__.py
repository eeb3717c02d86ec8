"""deskfleet.agent: what runs on every employee PC (the headless core, stage hosting, discovery)."""

from deskfleet.common.no_telemetry import block_openvino_telemetry

block_openvino_telemetry()  # before any module of this package imports openvino

"""deskfleet.controller: planning, deployment, the engine, the CLI and the benchmarks."""

from deskfleet.common.no_telemetry import block_openvino_telemetry

block_openvino_telemetry()  # before any module of this package imports openvino

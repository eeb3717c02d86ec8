"""Benchmarks behind `deskfleet bench ...`; each prints one JSON object."""

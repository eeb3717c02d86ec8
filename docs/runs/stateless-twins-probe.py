"""Probe (stop 43): a stage with no state, its KV held by the host at a fixed slot count, compiled at static shapes
once per width, against the stateful stage. Prints JSON: median milliseconds a call over interleaved blocks.

    .venv/bin/python docs/runs/stateless-twins-probe.py EXPORT_DIR [SLOTS]   (an export of the demo target)

Every call feeds `SLOTS` past slots (200 live) and T new tokens; "alt" alternates T=1 and T=9 calls. The stateful
stage is reset to a 200-token context before each block. The stateless graph is build_stage_model's fusion
without MakeStateful: the past key/value Parameters stay inputs, and the new keys/values (the second input of each
layer's concat) become outputs. Not part of the product; kept so the figures in README can be measured again.
"""

import collections
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from deskfleet.agent import stage as st
from deskfleet.agent.openvino_core import openvino_core
from deskfleet.agent.stage import CompileSettings, LayerRange, Stage, weight_group_size
from deskfleet.common.model_spec import Manifest, TensorNames, load_manifest

TARGET = Path(sys.argv[1])
SLOTS = int(sys.argv[2]) if len(sys.argv) > 2 else 256
LIVE = 200
MANIFEST = load_manifest(TARGET)
SPEC = MANIFEST.spec
SETTINGS = CompileSettings().for_drafting()
CORE = openvino_core()


def stateless_model() -> ov.Model:
    units = {stem: CORE.read_model(TARGET / f"{stem}.xml") for stem in MANIFEST.stage_ir_stems(0, SPEC.num_layers)}
    mask = st._parameter(TensorNames.ATTENTION_MASK, [-1, -1], ov.Type.i64)
    positions = st._parameter(TensorNames.POSITION_IDS, [-1, -1], ov.Type.i64)
    rope = units[Manifest.ROPE_IR]
    st._rewire(rope, TensorNames.POSITION_IDS, positions.output(0))
    st._rewire(rope, TensorNames.ATTENTION_MASK, mask.output(0))
    cos, sin, bias = (st._produced(rope, name) for name in (TensorNames.COS, TensorNames.SIN,
                                                             TensorNames.ATTENTION_BIAS))
    ids = st._parameter(TensorNames.INPUT_IDS, [-1, -1], ov.Type.i64)
    st._rewire(units[Manifest.EMBED_IR], TensorNames.INPUT_IDS, ids.output(0))
    hidden = st._produced(units[Manifest.EMBED_IR], TensorNames.EMBED_OUT)
    pasts, news = [], []
    for index in range(SPEC.num_layers):
        layer = units[Manifest.layer_ir(index)]
        st._rewire(layer, TensorNames.layer_hidden_in(index), hidden)
        st._rewire(layer, TensorNames.ATTENTION_BIAS, bias)
        st._rewire(layer, TensorNames.COS, cos)
        st._rewire(layer, TensorNames.SIN, sin)
        for kind in ("key", "value"):
            pasts.append(st._input_node(layer, TensorNames.past(kind, index)))
            concat = st._produced(layer, TensorNames.present(kind, index)).get_node()
            assert concat.get_type_name() == "Concat", concat.get_type_name()
            news.append(ops.result(concat.input_value(1)))
        hidden = st._produced(layer, TensorNames.layer_hidden_out(index))
    wanted = st._parameter(TensorNames.LOGITS_POSITIONS, [-1, -1], ov.Type.i64)
    selected = ops.gather(hidden, wanted, ops.constant(np.int64(1)), batch_dims=1)
    head = units[Manifest.HEAD_IR]
    st._rewire(head, TensorNames.HEAD_IN, selected.output(0))
    next_tokens = st._result_node(head, TensorNames.NEXT_TOKENS)
    argmax = st.first_max_index(st._produced(head, TensorNames.LOGITS), SPEC.vocab_size)
    argmax.get_tensor().set_names({TensorNames.NEXT_TOKENS})
    next_tokens.input(0).replace_source_output(argmax)
    return ov.Model([next_tokens, *news], [ids, mask, positions, wanted, *pasts], "stateless")


def compile_stateless(width: int | None) -> ov.CompiledModel:
    """width None: T dynamic (one compiled model for every width)."""
    model = stateless_model()
    t = -1 if width is None else width
    shapes = {TensorNames.INPUT_IDS: [1, t], TensorNames.ATTENTION_MASK: [1, -1 if width is None else SLOTS + t],
              TensorNames.POSITION_IDS: [1, t], TensorNames.LOGITS_POSITIONS: [1, t]}
    for parameter in model.get_parameters():
        name = parameter.output(0).get_any_name()
        if name not in shapes:
            shape = parameter.get_output_partial_shape(0)
            shapes[name] = [1, shape[1].get_length(), SLOTS, shape[3].get_length()]
    model.reshape({name: ov.PartialShape(shape) for name, shape in shapes.items()})
    return CORE.compile_model(model, SETTINGS.device, SETTINGS.properties(weight_group_size(model)))


class StatelessRequest:
    def __init__(self, compiled: ov.CompiledModel, past: dict[str, np.ndarray]) -> None:
        self.request = compiled.create_infer_request()
        for port in compiled.inputs:
            if port.get_any_name() in past:  # zero copy: the host's buffers are the request's inputs
                self.request.set_tensor(port, ov.Tensor(past[port.get_any_name()], shared_memory=True))

    def call(self, width: int) -> np.ndarray:
        mask = np.zeros((1, SLOTS + width), np.int64)
        mask[0, :LIVE] = 1
        mask[0, SLOTS:] = 1
        self.request.set_tensor(TensorNames.ATTENTION_MASK, ov.Tensor(mask))
        self.request.set_tensor(TensorNames.POSITION_IDS, ov.Tensor(np.arange(LIVE, LIVE + width)[None]))
        self.request.set_tensor(TensorNames.INPUT_IDS, ov.Tensor(np.full((1, width), 5, np.int64)))
        self.request.set_tensor(TensorNames.LOGITS_POSITIONS, ov.Tensor(np.arange(width)[None]))
        self.request.start_async()
        self.request.wait()
        return self.request.get_tensor(TensorNames.NEXT_TOKENS).data.copy()


def block(calls, repeats: int) -> list[float]:
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for index, call in enumerate(calls):
            began = time.perf_counter()
            call()
            times[index].append(time.perf_counter() - began)
    return [statistics.median(column) * 1e3 for column in times]


def main() -> None:
    static = {width: compile_stateless(width) for width in (1, 9)}
    rng = np.random.default_rng(0)
    past = {port.get_any_name(): (rng.standard_normal(list(port.get_shape())) * 0.1).astype(np.float32)
            for port in static[1].inputs if port.get_any_name().startswith("past")}
    one, nine = StatelessRequest(static[1], past), StatelessRequest(static[9], past)
    dynamic = StatelessRequest(compile_stateless(None), past)
    session = Stage(TARGET, MANIFEST, LayerRange(0, SPEC.num_layers, SPEC.num_layers), SETTINGS).open_session()
    context = [LIVE]

    def prefill() -> None:
        session.reset()
        session.forward(np.full((1, LIVE), 5, np.int64), np.ones((1, LIVE), np.int64), np.arange(LIVE)[None],
                        np.zeros(1, np.int32), logits_positions=np.array([[LIVE - 1]]))
        context[0] = LIVE

    def stateful(width: int) -> None:
        start = context[0]
        session.forward(np.full((1, width), 5, np.int64), np.ones((1, start + width), np.int64),
                        np.arange(start, start + width)[None], np.zeros(1, np.int32))
        context[0] = start + width

    found = collections.defaultdict(list)
    for _ in range(8):
        prefill()
        found["stateful T1"].append(block([lambda: stateful(1)], 40)[0])
        prefill()
        found["stateful T9"].append(block([lambda: stateful(9)], 20)[0])
        prefill()
        for name, ms in zip(("stateful alt T1", "stateful alt T9"), block([lambda: stateful(1), lambda: stateful(9)], 20)):
            found[name].append(ms)
        found["static T1"].append(block([lambda: one.call(1)], 40)[0])
        found["static T9"].append(block([lambda: nine.call(9)], 20)[0])
        for name, ms in zip(("static alt T1", "static alt T9"), block([lambda: one.call(1), lambda: nine.call(9)], 20)):
            found[name].append(ms)
        for name, ms in zip(("dynamic alt T1", "dynamic alt T9"),
                            block([lambda: dynamic.call(1), lambda: dynamic.call(9)], 20)):
            found[name].append(ms)
    print(json.dumps({"slots": SLOTS, "live": LIVE, "median_ms": {name: round(statistics.median(values), 3)
                                                                  for name, values in found.items()}}))


if __name__ == "__main__":
    main()

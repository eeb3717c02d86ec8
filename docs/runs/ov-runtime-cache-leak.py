#!/usr/bin/env python3
"""Minimal repro (openvino + numpy only): each CPU CompiledModel that is compiled, run over several
input shapes and released leaves heap memory and one native thread behind, while the CPU plugin's
runtime cache (CPU_RUNTIME_CACHE_CAPACITY) is on.

Per cycle: compile -> create_infer_request -> calls over --shapes distinct shapes -> release_memory()
-> drop every reference -> gc.collect() -> sleep. One JSON line per cycle, a JSON summary at the end.

Trigger found: the KV state read through Gather(beam_idx) (ReadValue -> Gather -> Concat -> SDPA), which the
CPU plugin fuses into its stateful ScaledDotProductAttention node. Without that Gather (--no-beam-gather),
or with CPU_RUNTIME_CACHE_CAPACITY=0, memory and thread count stay flat.

Models (--model):
  stage           (default) rope.xml + layer_002..003.xml of --ir-dir fused with plain OpenVINO into one
                  stateful model (MakeStateful, Gather(beam_idx) on each KV read, zero-length initial state).
  layer-stateful  one one decoder-layer IR (a .xml with past_key/past_value inputs and
                  present_key/present_value outputs, ScaledDotProductAttention inside), made stateful
                  with openvino's MakeStateful pass: KV in ReadValue/Assign, dynamic batch and sequence.
  layer           the same IR as is (stateless: the past KV fed as inputs).
  synthetic       a small stateful attention block built with openvino.opset13 (no files needed).
"""
import argparse
import gc
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino import passes

DEFAULT_IR = "out/demo/target-int4/layer_000.xml"  # from the repo root, after scripts/demo.sh


def proc_status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, v = line.split(":", 1)
            if k in ("VmRSS", "RssAnon", "RssFile"):
                out[k + "_kB"] = int(v.split()[0])
    out["threads"] = len(os.listdir("/proc/self/task"))
    je = jemalloc_allocated_kB()
    if je is not None:
        out["je_allocated_kB"] = je
    return out


_je = None


def jemalloc_allocated_kB():
    """jemalloc's stats.allocated (live heap bytes, allocator caches excluded) when it is preloaded, else None."""
    global _je
    if "jemalloc" not in os.environ.get("LD_PRELOAD", ""):
        return None
    import ctypes
    if _je is None:
        _je = ctypes.CDLL(next(p for p in os.environ["LD_PRELOAD"].split() if "jemalloc" in p))
    e, sz = ctypes.c_uint64(1), ctypes.c_size_t(8)
    _je.mallctl(b"epoch", ctypes.byref(e), ctypes.byref(sz), ctypes.byref(e), sz)
    v, s = ctypes.c_size_t(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_size_t))
    if _je.mallctl(b"stats.allocated", ctypes.byref(v), ctypes.byref(s), None, ctypes.c_size_t(0)) != 0:
        return None
    return v.value >> 10


# ---------------------------------------------------------------- models

def _find(ports, prefix):
    for p in ports:
        for n in p.get_names():
            if n.startswith(prefix):
                return p, n
    raise KeyError(prefix)


def load_layer(core, path, stateful):
    model = core.read_model(path)
    if stateful:
        pairs = {}
        for kind in ("key", "value"):
            _, past = _find(model.inputs, f"past_{kind}")
            _, present = _find(model.outputs, f"present_{kind}")
            pairs[past] = present
        m = passes.Manager()
        m.register_pass(passes.MakeStateful(pairs))
        m.run_passes(model)
        _zero_length_init(model, model.inputs[0].get_node())  # initial state [B, kv, 0, D]
    return model


def _param(name, shape, et):
    p = ops.parameter(ov.PartialShape(shape), et, name=name)
    p.output(0).get_tensor().set_names({name})
    return p


def _rewire(model, prefix, source):
    port, _ = _find(model.inputs, prefix)
    for target in list(port.get_node().output(0).get_target_inputs()):
        target.replace_source_output(source)


def _produced(model, prefix):
    port, _ = _find(model.outputs, prefix)
    return port.get_node().input_value(0)


def build_stage(core, ir_dir, lo, hi, use_rope=True, beam_gather=True):
    """Plain-OpenVINO fusion of rope.xml + layer_{lo..hi-1}.xml into one stateful model (a middle pipeline
    stage: hidden_states in, hidden out), like the application does: each layer's past KV Parameter /
    present KV Result become a ReadValue/Assign pair (MakeStateful), each past read goes through
    Gather(beam_idx), and the initial state is [B, kv, 0, D] with B from the input.
    use_rope=False: cos/sin/attention_bias are stage inputs instead of being computed by rope.xml."""
    layers = [core.read_model(f"{ir_dir}/layer_{i:03d}.xml") for i in range(lo, hi)]
    H = layers[0].inputs[0].get_partial_shape()[2].get_length()
    hidden_in = _param("hidden_states", [-1, -1, H], ov.Type.f32)
    params = [hidden_in]
    if use_rope:
        rope = core.read_model(f"{ir_dir}/rope.xml")
        attention_mask = _param("attention_mask", [-1, -1], ov.Type.i64)
        position_ids = _param("position_ids", [-1, -1], ov.Type.i64)
        _rewire(rope, "position_ids", position_ids.output(0))
        _rewire(rope, "attention_mask", attention_mask.output(0))
        cos, sin, bias = (_produced(rope, n) for n in ("rope_cos", "rope_sin", "attention_bias"))
        params += [attention_mask, position_ids]
    else:
        d = layers[0].inputs[2].get_partial_shape()[2].get_length()
        pb, pc, ps = (_param("attention_bias", [-1, 1, -1, -1], ov.Type.f32),
                      _param("rope_cos", [-1, -1, d], ov.Type.f32), _param("rope_sin", [-1, -1, d], ov.Type.f32))
        bias, cos, sin = pb.output(0), pc.output(0), ps.output(0)
        params += [pb, pc, ps]
    if beam_gather:
        beam_idx = _param("beam_idx", [-1], ov.Type.i32)
        params.append(beam_idx)
    hidden = hidden_in.output(0)
    kv_pairs, pasts, presents = [], [], []
    for i, layer in zip(range(lo, hi), layers):
        _rewire(layer, f"layer_{i:03d}.hidden_in", hidden)
        _rewire(layer, "attention_bias", bias)
        _rewire(layer, "rope_cos", cos)
        _rewire(layer, "rope_sin", sin)
        for kind in ("key", "value"):
            past = _find(layer.inputs, f"past_{kind}.{i:03d}")[0].get_node()
            if beam_gather:
                consumers = list(past.output(0).get_target_inputs())
                g = ops.gather(past, beam_idx, ops.constant(np.int64(0)))
                for t in consumers:
                    t.replace_source_output(g.output(0))
            present = _find(layer.outputs, f"present_{kind}.{i:03d}")[0].get_node()
            kv_pairs.append((past, present))
            pasts.append(past)
            presents.append(present)
        hidden = _produced(layer, f"layer_{i:03d}.hidden_out")
    out = ops.result(hidden)
    out.output(0).get_tensor().set_names({"stage_hidden_out"})
    model = ov.Model([out] + presents, params + pasts, f"stage-{lo}-{hi}")
    m = passes.Manager()
    m.register_pass(passes.MakeStateful(kv_pairs))
    m.run_passes(model)
    _zero_length_init(model, hidden_in)
    return model


def _zero_length_init(model, like):
    batch = ops.gather(ops.shape_of(like, "i64"), ops.constant(np.array([0], np.int64)), ops.constant(np.int64(0)))
    for op in model.get_ops():
        if op.get_type_name() == "ReadValue":
            shp = op.get_output_partial_shape(0)
            dims = [batch] + [ops.constant(np.array([0 if i == 2 else shp[i].get_length()], np.int64))
                              for i in range(1, 4)]
            op.set_arguments([ops.broadcast(ops.constant(np.float32(0)), ops.concat(dims, 0))])
    model.validate_nodes_and_infer_types()


def build_synthetic(H=256, heads=4, kv_heads=4, D=64, seed=0, beam_gather=True):
    """hidden [B,T,H] f32 -> hidden [B,T,H]; KV state [B,kv_heads,S,D] via ReadValue/Assign; SDPA."""
    rng = np.random.default_rng(seed)
    w = lambda a, b: ops.constant((rng.standard_normal((a, b)) * 0.05).astype(np.float32))
    x = ops.parameter(ov.PartialShape([-1, -1, H]), ov.Type.f32, name="hidden")
    x.output(0).get_tensor().set_names({"hidden"})
    bias = ops.parameter(ov.PartialShape([-1, 1, -1, -1]), ov.Type.f32, name="attention_bias")
    bias.output(0).get_tensor().set_names({"attention_bias"})
    params = [x, bias]
    if beam_gather:
        beam_idx = _param("beam_idx", [-1], ov.Type.i32)
        params.append(beam_idx)
    zero = ops.constant(np.int64(0))
    batch = ops.gather(ops.shape_of(x, "i64"), ops.constant(np.array([0], np.int64)), zero)

    def heads_of(t, n):  # [B,T,n*D] -> [B,n,T,D]
        r = ops.reshape(t, ops.constant(np.array([0, 0, n, D], np.int64)), special_zero=True)
        return ops.transpose(r, ops.constant(np.array([0, 2, 1, 3], np.int64)))

    q = heads_of(ops.matmul(x, w(H, heads * D), False, False), heads)
    k_new = heads_of(ops.matmul(x, w(H, kv_heads * D), False, False), kv_heads)
    v_new = heads_of(ops.matmul(x, w(H, kv_heads * D), False, False), kv_heads)
    sinks, caches = [], []
    for name, new in (("past_key", k_new), ("past_value", v_new)):
        init = ops.broadcast(ops.constant(np.float32(0)),
                             ops.concat([batch, ops.constant(np.array([kv_heads, 0, D], np.int64))], 0))
        info = ov.op.util.VariableInfo()
        info.data_shape, info.data_type, info.variable_id = ov.PartialShape([-1, kv_heads, -1, D]), ov.Type.f32, name
        var = ov.op.util.Variable(info)
        rv = ops.read_value(init, var)
        if beam_gather:
            rv = ops.gather(rv, beam_idx, zero)
        cat = ops.concat([rv, new], axis=2)
        sinks.append(ops.assign(cat, var))
        caches.append(cat)
    k, v = caches
    rep = heads // kv_heads  # GQA: repeat kv heads
    if rep > 1:
        def expand(t):
            u = ops.unsqueeze(t, ops.constant(np.int64(2)))  # [B,kv,1,S,D]
            shp = ops.shape_of(u, "i64")
            tgt = ops.multiply(shp, ops.constant(np.array([1, 1, rep, 1, 1], np.int64)))
            b = ops.broadcast(u, tgt)
            return ops.reshape(b, ops.constant(np.array([0, heads, -1, D], np.int64)), special_zero=True)
        k, v = expand(k), expand(v)
    att = ops.scaled_dot_product_attention(q, k, v, bias, ops.constant(np.float32(1 / np.sqrt(D))), causal=False)  # [B,heads,T,D]
    att = ops.transpose(att, ops.constant(np.array([0, 2, 1, 3], np.int64)))
    att = ops.reshape(att, ops.constant(np.array([0, 0, heads * D], np.int64)), special_zero=True)
    h = ops.add(x, ops.matmul(att, w(heads * D, H), False, False))
    ff = ops.matmul(ops.swish(ops.matmul(h, w(H, 4 * H), False, False)), w(4 * H, H), False, False)
    out = ops.result(ops.add(h, ff))
    out.output(0).get_tensor().set_names({"hidden_out"})
    return ov.Model([out], sinks, params, "synthetic_stateful_attn")


# ---------------------------------------------------------------- feeding

def feeds_for(model_inputs, B, T, P, H, rng):
    """Inputs of one call: B rows, T new tokens, P past slots (S = P + T)."""
    S = P + T
    feed = {}
    for port in model_inputs:
        name = port.get_any_name()
        ps = port.get_partial_shape()
        if name == "attention_mask":
            feed[name] = np.ones((B, S), np.int64)
        elif name == "position_ids":
            feed[name] = np.broadcast_to(np.arange(P, S, dtype=np.int64), (B, T)).copy()
        elif name == "beam_idx":
            feed[name] = np.arange(B, dtype=np.int32)
        elif name == "input_ids":
            feed[name] = rng.integers(3, 1000, (B, T)).astype(np.int64)
        elif name == "logits_positions":
            feed[name] = np.full((B, 1), T - 1, np.int64)
        elif "bias" in name:  # [B,1,T,S] causal additive mask
            m = np.triu(np.full((T, S), -1e4, np.float32), k=P + 1)
            feed[name] = np.broadcast_to(m, (B, 1, T, S)).copy()
        elif "cos" in name or "sin" in name:
            d = ps[2].get_length()
            pos = np.arange(P, S, dtype=np.float32)[None, :, None] / (10000 ** (np.arange(d) / d))
            feed[name] = np.broadcast_to((np.cos(pos) if "cos" in name else np.sin(pos)), (B, T, d)).astype(np.float32)
        elif name.startswith("past_"):  # stateless layer: KV fed as input
            feed[name] = (rng.standard_normal((B, ps[1].get_length(), P, ps[3].get_length())) * 0.1).astype(np.float32)
        else:  # hidden states
            feed[name] = rng.standard_normal((B, T, H)).astype(np.float32)
    return feed


def shape_plan(n):
    """n distinct (batch, new tokens) prefill shapes: T = 1..n, batch alternating 1, 2."""
    return [(1 + (i % 2), i + 1) for i in range(n)]


# ---------------------------------------------------------------- one cycle

def run_cycle(core, model, props, n_shapes, H, rng, use_async, decode_steps):
    compiled = core.compile_model(model, "CPU", props)
    req = compiled.create_infer_request()
    stateful = len(req.query_state()) > 0
    calls = 0
    for B, T in shape_plan(n_shapes):
        if stateful:
            req.reset_state()
        # prefill T tokens, then decode_steps single-token calls on top (stateless: past fed in)
        P = 0
        for t in [T] + [1] * decode_steps:
            feed = feeds_for(compiled.inputs, B, t, P, H, rng)
            if use_async:
                req.start_async(feed)
                req.wait()
            else:
                req.infer(feed)
            calls += 1
            P += t
    if stateful:
        req.reset_state()
    compiled.release_memory()
    del req, compiled, feed
    return calls


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("stage", "layer-stateful", "layer", "synthetic"), default="stage")
    ap.add_argument("--layers", default="2-4", help="--model stage: layer range lo-hi of --ir-dir")
    ap.add_argument("--no-rope", action="store_true", help="--model stage: feed cos/sin/bias, no rope.xml")
    ap.add_argument("--no-beam-gather", action="store_true", help="--model stage/synthetic: no Gather(beam_idx) on KV reads")
    ap.add_argument("--ir", default=DEFAULT_IR, help="decoder-layer IR .xml for --model layer*")
    ap.add_argument("--ir-dir", default=os.path.dirname(DEFAULT_IR), help="export folder for --model stage")
    ap.add_argument("--runtime-cache-capacity", type=int, default=None,
                    help="CPU_RUNTIME_CACHE_CAPACITY (default: not set = plugin default)")
    ap.add_argument("--cycles", type=int, default=15)
    ap.add_argument("--shapes", type=int, default=10, help="distinct input shapes per compiled model")
    ap.add_argument("--decode-steps", type=int, default=1, help="1-token calls after each prefill")
    ap.add_argument("--threads", type=int, default=None, help="INFERENCE_NUM_THREADS")
    ap.add_argument("--sleep", type=float, default=1.0)
    ap.add_argument("--sync", action="store_true", help="infer() instead of start_async()+wait()")
    ap.add_argument("--worker-thread", action="store_true",
                    help="compile/run/release on a ThreadPoolExecutor worker (as asyncio.to_thread would)")
    a = ap.parse_args()

    core = ov.Core()
    if a.model == "synthetic":
        model, H = build_synthetic(beam_gather=not a.no_beam_gather), 256
    elif a.model == "stage":
        lo, hi = map(int, a.layers.split("-"))
        model = build_stage(core, a.ir_dir, lo, hi, use_rope=not a.no_rope, beam_gather=not a.no_beam_gather)
        H = model.inputs[0].get_partial_shape()[2].get_length()
    else:
        model = load_layer(core, a.ir, stateful=(a.model == "layer-stateful"))
        H = model.inputs[0].get_partial_shape()[2].get_length()
    props = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32",
             "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}
    if a.threads:
        props["INFERENCE_NUM_THREADS"] = str(a.threads)
    if a.runtime_cache_capacity is not None:
        props["CPU_RUNTIME_CACHE_CAPACITY"] = str(a.runtime_cache_capacity)
    rng = np.random.default_rng(0)
    pool = ThreadPoolExecutor(1) if a.worker_thread else None

    print(json.dumps({"openvino": ov.get_version(), "model": a.model, "ir": {"synthetic": None, "stage": f"{a.ir_dir} rope={not a.no_rope} layers {a.layers} beam_gather={not a.no_beam_gather}"}.get(a.model, a.ir),
                      "props": props, "shapes": shape_plan(a.shapes), "decode_steps": a.decode_steps,
                      "LD_PRELOAD": os.environ.get("LD_PRELOAD", ""), "base": proc_status()}), flush=True)
    rows = []
    for c in range(1, a.cycles + 1):
        t0 = time.time()
        args = (core, model, props, a.shapes, H, rng, not a.sync, a.decode_steps)
        calls = pool.submit(run_cycle, *args).result() if pool else run_cycle(*args)
        gc.collect()
        time.sleep(a.sleep)
        st = proc_status()
        row = {"cycle": c, "RssAnon_kB": st["RssAnon_kB"], "threads": st["threads"], "VmRSS_kB": st["VmRSS_kB"],
               "calls": calls, "secs": round(time.time() - t0, 2)}
        if "je_allocated_kB" in st:
            row["je_allocated_kB"] = st["je_allocated_kB"]
        rows.append(row)
        print(json.dumps(row), flush=True)

    half = rows[len(rows) // 2:]
    if len(half) >= 2:
        n = half[-1]["cycle"] - half[0]["cycle"]
        summ = {"cycles": a.cycles, "shapes": a.shapes, "runtime_cache_capacity": a.runtime_cache_capacity,
                "last_half_from_cycle": half[0]["cycle"],
                "RssAnon_kB_per_cycle": round((half[-1]["RssAnon_kB"] - half[0]["RssAnon_kB"]) / n, 1),
                "threads_per_cycle": round((half[-1]["threads"] - half[0]["threads"]) / n, 2),
                "VmRSS_kB_per_cycle": round((half[-1]["VmRSS_kB"] - half[0]["VmRSS_kB"]) / n, 1),
                **({"je_allocated_kB_per_cycle": round((half[-1]["je_allocated_kB"] - half[0]["je_allocated_kB"]) / n, 1)}
                   if "je_allocated_kB" in half[0] else {}),
                "final": rows[-1]}
        print(json.dumps({"summary": summ}), flush=True)


if __name__ == "__main__":
    main()

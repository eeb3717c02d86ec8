#!/bin/bash
# The fleet's headline run on the lent machine (run S20 and later): install the carried wheels, make the 1.1B random
# Llama of runs H-L there (it cannot travel: 611 MB as INT4 IR against the 64 MiB a call carries), export it INT4,
# then run `bench fleet` with it as --model and the demo pair for the drafting rows.
#
# Settings (environment):
#   RUN         the run's name: files out/$RUN-*, work folder /tmp/$RUN, status file /tmp/$RUN/STATUS (required)
#   BENCH_ARGS  further `bench fleet` arguments (default below: 4 PCs, the controller on 2 cores, 3 rounds)
#   BENCHES     bench names, run in the order given (default "fleet"). A name starting "tp" runs the throughput rows
#               alone (no demo pair: no drafting or WAN rows); one holding "-old" runs the wheel in .whl2/old
#               (an A/B against an older commit: interleave them, e.g. "tp-new1 tp-old1 tp-new2")
#
# Carried (`run`'s carry): .whl (the cp312 wheels and this checkout's deskfleet wheel), .whl2 (openvino.tar.xz,
# stripped to its CPU plugin and the IR and PyTorch frontends) and .devrun (demo.tar.xz: out/demo's two exports).
# The shipped checkpoints' safetensors are moved out of the working tree for the call (the tree and the carry
# stay under 64 MiB only so). Start it with setsid from the repo root copy there, e.g. `mkdir -p /tmp/s20 &&
# (RUN=s20 setsid bash docs/runs/device-headline.sh > /tmp/s20/pipeline.log 2>&1 < /dev/null &)`, then collect
# with docs/runs/device-collect.sh in the same call and the next ones.
set -u
: "${RUN:?set RUN, e.g. RUN=s20}"
BENCH_ARGS=${BENCH_ARGS:-"--pcs 4 --controller-cores 2 --rounds 3"}
BENCHES=${BENCHES:-fleet}
export PYTHONUNBUFFERED=1
W=/tmp/$RUN; mkdir -p $W/out
t0=$SECONDS
ts() { echo "=== [$(date +%T)] +$((SECONDS-t0))s $*"; }
fail() { ts "FAILED: $*"; echo "FAILED $*" > $W/STATUS; exit 1; }
ts install; nproc; python3 --version
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || fail pip
tar -xJf .whl2/openvino.tar.xz -C /tmp/site || fail openvino-tar
if [ -d .whl2/old ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-old .whl2/old/*.whl \
    || fail pip-old
fi
export PYTHONPATH=/tmp/site
python3 -c 'import openvino as ov, nncf, deskfleet.controller.cli, cryptography, zeroconf, websockets, uvloop, jinja2, psutil, platformdirs, transformers; print("ov", ov.__version__, "nncf", nncf.__version__, "transformers", transformers.__version__, ov.Core().available_devices)' || fail imports
tar -xJf .devrun/demo.tar.xz -C $W || fail untar-demo
mkdir -p $W/assets && cp -r assets/models $W/assets/ || fail copy-assets  # the demo model's held-out prompts
cd $W
ts checkpoint
python3 -c "from pathlib import Path; from deskfleet.controller.export.random_checkpoint import make_random_checkpoint; make_random_checkpoint(Path('random-1.1b'), hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048)" || fail checkpoint
ts export
python3 -m deskfleet.controller.cli export random-1.1b -o random-1.1b-int4 --weights int4 || fail export
rm -rf random-1.1b
du -sh random-1.1b-int4 demo/*
for bench in $BENCHES; do
  ts "$bench bench"
  case $bench in tp*) demo=();; *) demo=(--demo-target demo/target-int4 --demo-draft demo/draft-int4);; esac
  case $bench in *-old*) path=/tmp/site-old:/tmp/site;; *) path=/tmp/site;; esac
  # shellcheck disable=SC2086  # $BENCH_ARGS is a list of arguments
  PYTHONPATH=$path python3 -m deskfleet.controller.cli bench fleet --model random-1.1b-int4 "${demo[@]}" $BENCH_ARGS \
      --json-out out/$RUN-$bench.json --markdown-out out/$RUN-$bench.md > out/$RUN-$bench.log 2>&1
  echo "$bench bench rc $?"
done
ts done
echo DONE > $W/STATUS

#!/bin/bash
# A drafting A/B on the lent machine (runs S17-S19 and later): install the carried wheels, train the 279M code
# target, export it, fine-tune the demo draft on its continuations, export that, then run `bench fleet` once per
# entry of BENCHES, each with this checkout's wheel or the "old" one, in the order given (interleave them: a, b, b, a).
#
# Settings (environment):
#   RUN       the run's name: files out/$RUN-*, work folder /tmp/$RUN, status file /tmp/$RUN/STATUS (required)
#   TRAIN_S   seconds of target training (default 240; 200 gave perplexity ~27, 240 ~18.6)
#   BENCHES   bench names, e.g. "code-new1 code-old1 code-old2 code-new2" (required). A name starting "demo-" runs
#             DEMO_ARGS, any other CODE_ARGS; a name holding "-old" or "-b" runs the old wheel, any other this one
#   CODE_ARGS `bench fleet` arguments of the code-target benches (default below: 4 PCs, 3 rounds, K 3 / 5 / 8)
#   DEMO_ARGS those of the demo-pair benches (default below); these need .devrun/demo.tar.xz (the two demo exports)
#   PROBE     Python printed before each bench to show which code it runs (default: the switch margin)
#
# Carried (`run`'s carry; the working tree and carry stay under 64 MiB only with
# assets/models/target/model.safetensors moved out for the call): .whl (the cp312 wheels and this checkout's
# deskfleet wheel), .whl2 (openvino.tar.xz, stripped, and old/ with the other deskfleet wheel) and .devrun
# (scratch.tar.xz, prepare.py's output, and demo.tar.xz where a demo bench runs). Start it with setsid from the repo
# root copy there, e.g. `mkdir -p /tmp/s20 && (RUN=s20 BENCHES="code-a1 code-b1 code-b2 code-a2" setsid bash
# docs/runs/device-ab.sh > /tmp/s20/pipeline.log 2>&1 < /dev/null &)`, then collect with docs/runs/device-collect.sh
# in the same call and the next ones: it works in /tmp/$RUN, so a later call's re-sent tree cannot disturb it.
#
# The runs made with it (before it took its settings, each was a copy of its own):
#   S17  RUN=s17 BENCHES="code-new code-old demo-new demo-old"
#        PROBE='import deskfleet.common.speculative as s; print("PROBE_AFTER_ROUNDS" in dir(s))'
#   S18  RUN=s18 BENCHES="code-new1 code-old1 code-old2 code-new2" (PROBE as S17's)
#   S19  RUN=s19 TRAIN_S=200 BENCHES="code-a1 code-b1 code-b2 code-a2" with --pcs 3 --rounds 2 in CODE_ARGS
set -u
: "${RUN:?set RUN, e.g. RUN=s20}" "${BENCHES:?set BENCHES, e.g. BENCHES='code-new1 code-old1 code-old2 code-new2'}"
TRAIN_S=${TRAIN_S:-240}
CODE_ARGS=${CODE_ARGS:-"--demo-target code-target-int4 --demo-draft code-draft-int4 --kv-cache f32 --pcs 4 --controller-cores 2 --threads-per-pc 2 --rounds 3 --new-tokens 64 --drafters spec --fixed-k 3 5 8 --no-wan"}
DEMO_ARGS=${DEMO_ARGS:-"--demo-target demo/target-int4 --demo-draft demo/draft-int4 --pcs 4 --controller-cores 2 --rounds 3 --drafters spec lookup first --no-wan --fixed-k 2 4 8"}
PROBE=${PROBE:-'import deskfleet.common.speculative as s; print("SWITCH_MARGIN", s.SWITCH_MARGIN)'}
export PYTHONUNBUFFERED=1
W=/tmp/$RUN; mkdir -p $W/out
t0=$SECONDS
ts() { echo "=== [$(date +%T)] +$((SECONDS-t0))s $*"; }
fail() { ts "FAILED: $*"; echo "FAILED $*" > $W/STATUS; exit 1; }
ts install; nproc; nvidia-smi -L; python3 --version
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || fail pip
tar -xJf .whl2/openvino.tar.xz -C /tmp/site || fail openvino-tar
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-old .whl2/old/*.whl || fail pip-old
export PYTHONPATH=/tmp/site
python3 -c 'import openvino as ov, nncf, deskfleet, deskfleet.controller.cli, cryptography, zeroconf, websockets, uvloop, jinja2, psutil, platformdirs; print("ov", ov.__version__, "nncf", nncf.__version__, ov.Core().available_devices)' || fail imports
mkdir -p $W/assets && cp -r assets/models $W/assets/ || fail copy-assets
tar -xJf .devrun/scratch.tar.xz -C $W || fail untar
case " $BENCHES" in *" demo-"*) tar -xJf .devrun/demo.tar.xz -C $W || fail untar-demo;; esac
cd $W
cmp .scratch/tokenizer/tokenizer.json assets/models/draft/tokenizer.json || fail tokenizer-differs
ts train
python3 assets/models/train/train_code_target.py --data .scratch/data --out run-code --draft-seconds 0 --target-seconds "$TRAIN_S" > out/train-stdout.log 2>&1 || { tail -30 out/train-stdout.log; fail train; }
tail -5 out/train-stdout.log
cp run-code/train_log.json out/$RUN-train-log.json
python3 -c 'import json,math; t=json.load(open("run-code/train_log.json"))["target"]; print("steps", t["steps"], "train_s", t["train_seconds"], "chosen", t["chosen_step"], "valid", t["valid_loss"], "heldout", t["heldout_loss"], "ppl %.2f" % math.exp(t["heldout_loss"]))'
ts export target
python3 assets/models/train/export.py --run run-code --tokenizer .scratch/tokenizer --dest code-models --names target || fail export-hf
python3 -m deskfleet.controller.cli export code-models/target -o code-target-int4 --weights int4 || fail export-target
ts finetune
cp -r assets/models/draft code-models/draft || fail copy-draft
python3 assets/models/train/finetune_draft.py --models code-models --max-seqs 384 --device cuda --out-log out/$RUN-finetune-log.json > out/finetune-stdout.log 2>&1 || { tail -30 out/finetune-stdout.log; fail finetune; }
tail -3 out/finetune-stdout.log
python3 -m deskfleet.controller.cli export code-models/draft -o code-draft-int4 --weights int4 || fail export-draft
du -sh code-target-int4 code-draft-int4
for bench in $BENCHES; do
  ts $bench bench
  case $bench in demo-*) args=$DEMO_ARGS;; *) args=$CODE_ARGS;; esac
  case $bench in *-old*|*-b*) path=/tmp/site-old:/tmp/site;; *) path=/tmp/site;; esac
  PYTHONPATH=$path python3 -c "$PROBE"
  # shellcheck disable=SC2086  # $args is a list of arguments
  PYTHONPATH=$path python3 -m deskfleet.controller.cli bench fleet $args --json-out out/$RUN-$bench.json --markdown-out out/$RUN-$bench.md > out/$RUN-$bench.log 2>&1
  echo "$bench bench rc $?"
done
ts done
echo DONE > $W/STATUS

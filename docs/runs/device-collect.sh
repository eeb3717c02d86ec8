#!/bin/bash
# device-collect.sh RUN [LIMIT_S]: wait for /tmp/RUN/STATUS (written by device-ab.sh at its end) or LIMIT_S seconds
# (default 500), then pack what has finished into $OUT. Call it within 30 s of the previous call's end, before the
# lent machine is given back; a bench still running when it packs goes on, for the next call to collect.
RUN=${1:?usage: device-collect.sh RUN [LIMIT_S]}
W=/tmp/$RUN; lim=${2:-500}; s=$SECONDS
while [ ! -f $W/STATUS ] && [ $((SECONDS-s)) -lt $lim ]; do
  sleep 15
  echo "--- +$((SECONDS-s))s: $(grep '^===' $W/pipeline.log | tail -1)"
done
echo "STATUS: $(cat $W/STATUS 2>/dev/null || echo running)"
cp $W/pipeline.log $OUT/$RUN-pipeline.log
(cd $W/out && tar czf $OUT/$RUN-out.tgz .)
ls -la $OUT
echo "===== pipeline log"; tail -60 $W/pipeline.log

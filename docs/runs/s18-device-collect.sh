#!/bin/bash
# wait18.sh LIMIT_S: wait for /tmp/s18/STATUS or LIMIT_S seconds; then pack the finished files into $OUT.
W=/tmp/s18; lim=${1:-500}; s=$SECONDS
while [ ! -f $W/STATUS ] && [ $((SECONDS-s)) -lt $lim ]; do
  sleep 15
  echo "--- +$((SECONDS-s))s: $(grep '^===' $W/pipeline.log | tail -1)"
done
echo "STATUS: $(cat $W/STATUS 2>/dev/null || echo running)"
cp $W/pipeline.log $OUT/s18-pipeline.log
(cd $W/out && tar czf $OUT/s18-out.tgz .)
ls -la $OUT
echo "===== pipeline log"; tail -60 $W/pipeline.log

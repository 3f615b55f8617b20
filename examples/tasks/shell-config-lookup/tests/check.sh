#!/bin/bash
set -u
fail=0
check() {  # check WANT CMD...
  local want=$1; shift
  local got; got=$("$@" 2>/dev/null)
  [ "$got" = "$want" ] && echo "ok $*" || { echo "FAIL $*: got [$got] want [$want]"; fail=1; }
}
cd /app
check 9090 ./get_config.sh port
check localhost ./get_config.sh host
check demo ./get_config.sh name
check demo ./get_config.sh NAME
check hello-from-env ./get_config.sh greeting
check 7 env APP_PORT=7 ./get_config.sh port
./get_config.sh nope >/dev/null 2>/tmp/err; rc=$?
[ $rc -eq 1 ] && grep -q "unknown key: nope" /tmp/err && echo "ok unknown" || { echo "FAIL unknown ($rc)"; fail=1; }
exit $fail

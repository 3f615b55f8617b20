#!/bin/bash
set -u
fail=0
work=$(mktemp -d)
cp -a /app/. "$work/"
cd "$work"
make clean >/dev/null 2>&1
make >/tmp/make.log 2>&1 || { echo "FAIL make"; cat /tmp/make.log; exit 1; }
out=$(./stats 1 2 3 4)
[ "$out" = "mean=2.50 sd=1.12" ] && echo "ok run" || { echo "FAIL run: $out"; fail=1; }
# a header change must rebuild the objects that include it
printf '\n/* touched */\n' >> util.h
touch -d 'now + 5 seconds' util.h
make >/tmp/make2.log 2>&1
grep -q 'main\.c' /tmp/make2.log && grep -q 'util\.c' /tmp/make2.log && echo "ok header deps" ||
  { echo "FAIL header change did not rebuild both objects"; cat /tmp/make2.log; fail=1; }
make clean >/dev/null 2>&1
ls *.o stats 2>/dev/null | grep -q . && { echo "FAIL clean left files"; fail=1; } || echo "ok clean"
grep -q 'touched' main.c util.c && { echo "FAIL sources changed"; fail=1; }
cmp -s main.c /tests/orig_main.c && cmp -s util.c /tests/orig_util.c || { echo "FAIL C sources were modified"; fail=1; }
rm -rf "$work"
exit $fail

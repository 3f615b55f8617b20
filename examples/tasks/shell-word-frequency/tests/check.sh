#!/bin/bash
# Each case compares wordfreq.sh's output with the expected text.
set -u
fail=0
expect() {  # expect NAME EXPECTED ARGS...
  local name=$1 want=$2; shift 2
  local got
  got=$(bash /app/wordfreq.sh "$@" 2>/dev/null)
  if [ "$got" != "$want" ]; then echo "FAIL $name: got [$got] want [$want]"; fail=1; else echo "ok $name"; fi
}
t=$(mktemp -d)
printf 'b a c b a b\nC c-c x9y\n' > "$t/one.txt"
expect sample "$(printf '4 the\n2 cat\n2 hat')" 3 /app/sample.txt
expect ties "$(printf '4 c\n3 b\n2 a\n1 x')" 4 "$t/one.txt"
expect all "$(printf '4 c\n3 b\n2 a\n1 x\n1 y')" 10 "$t/one.txt"
bash /app/wordfreq.sh 0 "$t/one.txt" >/dev/null 2>&1; [ $? -eq 2 ] && echo "ok zero" || { echo "FAIL zero"; fail=1; }
bash /app/wordfreq.sh 3 "$t/missing.txt" >/dev/null 2>&1
[ $? -eq 2 ] && echo "ok missing" || { echo "FAIL missing"; fail=1; }
bash /app/wordfreq.sh >/dev/null 2>&1; [ $? -eq 2 ] && echo "ok usage" || { echo "FAIL usage"; fail=1; }
rm -rf "$t"
exit $fail

#!/bin/bash
set -u
fail=0
t=$(mktemp -d)
mkdir -p "$t/my src" "$t/empty"
echo one > "$t/my src/a file.txt"
echo two > "$t/my src/-dash.txt"
echo three > "$t/my src/star*.txt"
echo skip > "$t/my src/notes.md"
out=$(/app/backup.sh "$t/my src" "$t/dest dir" 2>&1); rc=$?
[ $rc -eq 0 ] || { echo "FAIL exit $rc: $out"; fail=1; }
[ "$out" = "backed up 3 file(s)" ] || { echo "FAIL message: $out"; fail=1; }
for n in "a file" "-dash" "star*"; do
  cmp -s "$t/my src/$n.txt" "$t/dest dir/$n.txt.bak" || { echo "FAIL missing copy of $n"; fail=1; }
done
[ ! -e "$t/dest dir/notes.md.bak" ] || { echo "FAIL copied notes.md"; fail=1; }
out=$(/app/backup.sh "$t/empty" "$t/d2" 2>&1)
[ "$out" = "backed up 0 file(s)" ] || { echo "FAIL empty: $out"; fail=1; }
[ -d "$t/d2" ] || { echo "FAIL dest not created"; fail=1; }
rm -rf "$t"
[ $fail -eq 0 ] && echo "all ok"
exit $fail

#!/bin/bash
cat > /app/backup.sh <<'EOF'
#!/bin/bash
# Copy SRC/*.txt to DEST/*.txt.bak
src=$1
dest=$2
mkdir -p -- "$dest"
count=0
shopt -s nullglob
for f in "$src"/*.txt; do
  [ -f "$f" ] || continue
  cp -- "$f" "$dest/$(basename -- "$f").bak"
  count=$((count + 1))
done
echo "backed up $count file(s)"
EOF
chmod +x /app/backup.sh

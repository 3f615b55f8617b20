#!/bin/bash
cat > /app/wordfreq.sh <<'EOF'
#!/bin/bash
# Print the N most frequent words of FILE as "COUNT WORD".
if [ $# -ne 2 ] || ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: wordfreq.sh N FILE (N a positive integer)" >&2
  exit 2
fi
if [ ! -r "$2" ] || [ -d "$2" ]; then
  echo "wordfreq.sh: cannot read $2" >&2
  exit 2
fi
tr -cs 'A-Za-z' '\n' < "$2" | tr 'A-Z' 'a-z' | grep -v '^$' | sort | uniq -c |
  awk '{print $1, $2}' | sort -k1,1nr -k2,2 | head -n "$1"
EOF
chmod +x /app/wordfreq.sh

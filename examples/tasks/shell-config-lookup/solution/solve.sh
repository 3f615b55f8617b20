#!/bin/bash
cat > /app/get_config.sh <<'EOF'
#!/bin/bash
# Print a setting: APP_<KEY> from the environment, else the last KEY=VALUE in settings.conf.
key=$(printf '%s' "${1:-}" | tr 'A-Z' 'a-z')
[ -n "$key" ] || { echo "usage: get_config.sh KEY" >&2; exit 2; }
var="APP_$(printf '%s' "$key" | tr 'a-z' 'A-Z')"
if [ -n "${!var+set}" ]; then
  printf '%s\n' "${!var}"
  exit 0
fi
value=$(awk -F= -v k="$key" '
  /^[[:space:]]*(#|$)/ { next }
  { name = $1; sub(/^[[:space:]]+/, "", name); sub(/[[:space:]]+$/, "", name)
    if (tolower(name) == k) { v = substr($0, index($0, "=") + 1); sub(/^[[:space:]]+/, "", v)
      sub(/[[:space:]]+$/, "", v); found = 1 } }
  END { if (found) print v; else exit 1 }' "$(dirname "$0")/settings.conf") || {
  echo "unknown key: $1" >&2; exit 1; }
printf '%s\n' "$value"
EOF
chmod +x /app/get_config.sh

#!/bin/bash
cat > /app/merge.js <<'EOF'
"use strict";

const FORBIDDEN = new Set(["__proto__", "constructor", "prototype"]);

function isPlainObject(v) {
  return v !== null && typeof v === "object" && Object.getPrototypeOf(v) === Object.prototype;
}

function clone(v) {
  if (Array.isArray(v)) return v.map(clone);
  if (isPlainObject(v)) return deepMerge({}, v);
  return v;
}

function deepMerge(target, source) {
  const out = {};
  for (const key of Object.keys(target)) out[key] = clone(target[key]);
  for (const key of Object.keys(source)) {
    if (FORBIDDEN.has(key)) continue;
    const s = source[key];
    out[key] = isPlainObject(s) && isPlainObject(out[key]) ? deepMerge(out[key], s) : clone(s);
  }
  return out;
}

module.exports = { deepMerge };
EOF

#!/bin/bash
cat > /app/intervals.py <<'EOF'
"""Union of closed integer intervals."""


def merge(intervals):
    for start, end in intervals:
        if start > end:
            raise ValueError(f"interval ({start}, {end}) has start > end")
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out
EOF

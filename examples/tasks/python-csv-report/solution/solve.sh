#!/bin/bash
cat > /app/report.py <<'EOF'
"""Summarise a sales CSV into a JSON report."""

import csv
import json
import sys
from collections import defaultdict


def main(argv):
    src = argv[1] if len(argv) > 1 else "data/sales.csv"
    dest = argv[2] if len(argv) > 2 else "report.json"
    revenue = defaultdict(float)
    units = defaultdict(float)
    rows = 0
    with open(src, newline="") as f:
        for row in csv.DictReader(f):
            try:
                n, price = float(row["units"]), float(row["unit_price"])
            except (TypeError, ValueError):
                continue
            rows += 1
            revenue[row["region"]] += n * price
            units[row["product"]] += n
    top = min(units, key=lambda p: (-units[p], p)) if units else None
    report = {"total_revenue": round(sum(revenue.values()), 2),
              "by_region": {r: round(v, 2) for r, v in revenue.items()},
              "top_product": top, "rows": rows}
    with open(dest, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv)
EOF

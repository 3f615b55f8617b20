#!/bin/bash
set -e
cd /app
python3 - <<'EOF'
from pathlib import Path
p = Path("lru.py")
s = p.read_text()
s = s.replace("""            return default
        return self._data[key]""", """            return default
        self._data.move_to_end(key)
        return self._data[key]""")
s = s.replace("""            self._data[key] = value
            return""", """            self._data[key] = value
            self._data.move_to_end(key)
            return""")
s = s.replace("popitem(last=True)", "popitem(last=False)")
p.write_text(s)
EOF

#!/usr/bin/env bash
# The first screen of an experiment's report as a person sees it, as a PNG (needs chromium; not part of CI).
# usage: scripts/report_screenshot.sh runs/<experiment> [out.png]
set -euo pipefail
report="$(realpath "$1")/report/report.html"
[[ -f "$report" ]] || { echo "no report at $report (taxbench report $1 writes it)" >&2; exit 2; }
chromium --headless --no-sandbox --disable-gpu --window-size=1280,800 --screenshot="$(realpath -m "${2:-report.png}")" \
    "file://$report" 2>/dev/null

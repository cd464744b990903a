#!/usr/bin/env bash
# The first screen of an experiment's report as a person sees it, as a PNG (needs chromium; not part of CI).
# usage: scripts/report_screenshot.sh runs/<experiment> [out.png]
set -euo pipefail
[[ $# -ge 1 ]] || { echo "usage: $0 runs/<experiment> [out.png]" >&2; exit 2; }
report="$(realpath -m "$1")/report/report.html"
[[ -f "$report" ]] || { echo "no report at $report (taxbench report $1 writes it)" >&2; exit 2; }
browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
[[ -n "$browser" ]] || { echo "$0 needs chromium on PATH (e.g. apt-get install chromium); none found" >&2; exit 2; }
out="$(realpath -m "${2:-report.png}")"
# chromium's own stderr is noise (GPU and D-Bus warnings) unless it fails
if ! log=$("$browser" --headless --no-sandbox --disable-gpu --window-size=1280,800 --screenshot="$out" \
    "file://$report" 2>&1) || [[ ! -s "$out" ]]; then
    echo "$browser failed to write $out:" >&2
    printf '%s\n' "$log" | tail -n 5 >&2
    exit 1
fi
echo "$out"

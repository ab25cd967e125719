"""Regenerate docs/report.png: the HTML report of the demo's faulty dump, as a headless
Chromium (the system's) shows it.

    python scripts/report-screenshot.py [OUT.png]

Runs ``kvcanary demo --keep DIR`` and ``kvcanary audit DIR/faulty.npz --html DIR/report.html``,
then screenshots the top of the page (summary, both maps, the first findings)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from browser import Browser, find_chromium  # noqa: E402

WIDTH, HEIGHT = 1200, 1600


def main() -> None:
    default = os.path.normpath(os.path.join(HERE, "..", "docs", "report.png"))
    out = sys.argv[1] if len(sys.argv) > 1 else default
    chromium = find_chromium()
    if chromium is None:
        raise SystemExit("needs chromium (the distribution's package)")
    with tempfile.TemporaryDirectory(prefix="kvcanary-shot-") as work:
        kvcanary = [sys.executable, "-m", "kvcanary"]
        subprocess.run([*kvcanary, "demo", "--keep", work], check=True, stdout=subprocess.DEVNULL)
        page = os.path.join(work, "report.html")
        done = subprocess.run([*kvcanary, "audit", os.path.join(work, "faulty.npz"),
                               "--html", page], stdout=subprocess.DEVNULL)
        if done.returncode != 1:
            raise SystemExit(f"the audit of the faulty dump exited {done.returncode}, not 1")
        with Browser(chromium, width=WIDTH, height=HEIGHT) as browser:
            tab = browser.open("file://" + page)
            if tab.console_errors:
                raise SystemExit(f"the page logged errors: {tab.console_errors}")
            # The dump's temporary path would show in the headings: name it as the docs do.
            tab.evaluate("document.querySelectorAll('h2').forEach((h) => h.textContent = "
                         "'demo/faulty.npz')")
            png = tab.screenshot_png()
    with open(out, "wb") as f:
        f.write(png)
    print(f"wrote {out} ({len(png)} bytes)")


if __name__ == "__main__":
    main()

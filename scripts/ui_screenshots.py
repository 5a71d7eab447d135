"""Screenshots of the web UI's pages (docs/ui/*.png), from a running `qkscope serve`.

    python scripts/ui_screenshots.py --api http://127.0.0.1:8000 --study 1 --trial 1 --compare 1,6
    python scripts/ui_screenshots.py --study 2 --trial 9 --lr-sensitivity 2 --only lr_sensitivity

Drives the OS's Chromium (Playwright); with API tokens on, pass --token (it goes into the
page's sessionStorage, as the token prompt would put it, never into an address).
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--api", default="http://127.0.0.1:8000")
    p.add_argument("--study", type=int, required=True)
    p.add_argument("--trial", type=int, required=True)
    p.add_argument("--compare", default=None, help="2-4 trial ids, comma-separated")
    p.add_argument(
        "--lr-sensitivity",
        type=int,
        default=None,
        metavar="STUDY",
        help="also the LR-sensitivity panel of this study (lr_sensitivity.png)",
    )
    p.add_argument("--only", default=None, help="just this page (e.g. lr_sensitivity)")
    p.add_argument("--token", default=None)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "ui")
    p.add_argument("--chromium", default="/usr/bin/chromium")
    args = p.parse_args()
    from playwright.sync_api import sync_playwright

    pages = [("studies", "#/", "studies"), ("study", f"#/studies/{args.study}", "studycharts"),
             ("trial", f"#/trials/{args.trial}", "trial")]  # fmt: skip
    if args.compare:
        pages.append(("compare", f"#/trials/{args.compare}", "trial"))
    panel = {}  # page name -> the element to shoot instead of the whole page
    if args.lr_sensitivity:
        pages.append(("lr_sensitivity", f"#/studies/{args.lr_sensitivity}", "lrsens"))
        panel["lr_sensitivity"] = f"#lrsens-panel-{args.lr_sensitivity}"
    if args.only:
        pages = [pg for pg in pages if pg[0] == args.only]
    args.out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
        for name, hash_, ready in pages:
            ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
            if args.token:
                ctx.add_init_script(f"sessionStorage.setItem('qkscope.token', {args.token!r})")
            page = ctx.new_page()
            page.goto(f"{args.api}/ui/{hash_}")
            page.wait_for_selector(f"html[data-ready{ready}]", state="attached", timeout=30_000)
            page.wait_for_timeout(2500)  # importance and the last charts
            path = args.out / f"{name}.png"
            if name in panel:
                page.locator(panel[name]).screenshot(path=str(path))
            else:
                page.screenshot(path=str(path), full_page=True)
            print(f"wrote {path}")
            ctx.close()
        browser.close()


if __name__ == "__main__":
    main()

"""Screenshots of TensorBoard showing the main job's logs, for the README, taken in headless Chromium.

    python docs/screenshots.py                 # runs the README's main job first if ./runs is missing
    python docs/screenshots.py --logdir runs   # or screenshot logs you already have

Starts ``tensorboard`` on 127.0.0.1 over ``--logdir`` exactly as a user would, waits until its HParams
table holds the tuner's rows, then drives Debian's Chromium (package ``chromium``) with Playwright
(``pip install -e ".[screenshots]"``) through each tab as a user would, and writes
``docs/screenshots/<tab>.png``. Nothing is drawn by hand: what the PNGs show is what TensorBoard's own
front end renders from the files the callback wrote.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from lightning_ckpt.report.tags import hparam_name

ROOT = Path(__file__).resolve().parent.parent
# name -> (the page's query and tab, as a user would open it; a checkbox label to click there, or "").
TABS = {
    "hparams": ("#hparams", ""),  # the trial table: plan dimensions, samples/s, memory; winner marked
    "text": ("#text", ""),  # summary (verdict first), plan, memory breakdown
    "images": ("#images", "Show actual image size"),  # the Pareto figure, full size
    # samples/s measured alone per trial, their best-so-far curve, and the side-by-side figures the plan was
    # chosen on (confirm/); smoothing 0 because consecutive trials are unrelated plans
    "timeseries": (
        "?tagFilter=lightning_ckpt%2F(search%2Fbest%7Ctrial%2Fsamples%7Cconfirm)&smoothing=0#timeseries",
        "",
    ),
}
CHROMIUM_FLAGS = [
    "--no-sandbox", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--hide-scrollbars",
    "--use-angle=swiftshader", "--enable-unsafe-swiftshader",  # software WebGL: Time Series draws its lines
]  # fmt: skip


def find_chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    sys.exit("Chromium not found: install Debian's package (apt-get install chromium) or put it on PATH.")


def start_tensorboard(logdir: Path) -> tuple[subprocess.Popen[str], str]:
    exe = shutil.which("tensorboard") or str(Path(sys.executable).with_name("tensorboard"))
    proc = subprocess.Popen(
        [exe, "--logdir", str(logdir), "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        found = re.search(r"(http://127\.0\.0\.1:\d+)/", line)
        if found:
            return proc, found.group(1)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    sys.exit("tensorboard did not start")


def wait_for_trials(url: str, timeout: float = 120.0) -> None:
    body = json.dumps({"experimentName": ""}).encode()
    headers = {"X-XSRF-Protected": "1", "Content-Type": "application/json"}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        request = urllib.request.Request(f"{url}/data/plugin/hparams/experiment", data=body, headers=headers)
        with urllib.request.urlopen(request, timeout=30) as response:
            if any(h["name"] == hparam_name("plan") for h in json.loads(response.read()).get("hparamInfos", [])):
                return
        time.sleep(1.0)
    sys.exit(f"TensorBoard at {url} shows no tuner trials in HParams: is --logdir the logs of a tuned fit?")


def take_screenshots(chromium: str, url: str, out_dir: Path, *, width: int, height: int, wait_ms: int) -> list[Path]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sys.exit('Playwright is not installed: pip install -e ".[screenshots]" (it drives the system Chromium).')
    written = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            for name, (where, click) in TABS.items():
                page.goto(f"{url}/{where}")
                page.wait_for_load_state("networkidle")
                if click:
                    page.get_by_text(click).click()
                page.wait_for_timeout(wait_ms)  # TensorBoard fetches and draws after the page has loaded
                out = out_dir / f"{name}.png"
                page.screenshot(path=str(out))
                if out.stat().st_size < 10_000:
                    sys.exit(f"Chromium wrote no usable screenshot of {url}/{where}")
                written.append(out)
        finally:
            browser.close()
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", type=Path, default=Path("runs"), help="TensorBoard logs (default: ./runs)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots", help="where the PNGs go")
    parser.add_argument("--width", type=int, default=1500)
    parser.add_argument("--height", type=int, default=950)
    parser.add_argument("--wait-ms", type=int, default=5_000, help="how long each tab gets to fetch and draw")
    args = parser.parse_args(argv)

    chromium = find_chromium()
    if not args.logdir.exists():
        print(f"{args.logdir} does not exist: running the README's main job (examples/train_gpt.py) first")
        subprocess.run(
            [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--logs", str(args.logdir)], check=True
        )
    args.out.mkdir(parents=True, exist_ok=True)
    proc, url = start_tensorboard(args.logdir)
    try:
        wait_for_trials(url)
        for out in take_screenshots(
            chromium, url, args.out, width=args.width, height=args.height, wait_ms=args.wait_ms
        ):
            print(f"wrote {out} ({out.stat().st_size // 1024} KiB)")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()

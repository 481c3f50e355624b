#!/usr/bin/env python
"""The figures of docs/tracking.md, made from a real sweep, a real TensorBoard server and
a real headless browser.

1. ``fededge sweep``: compressor none / onebit (+ error feedback), two seeds, the MLP on
   digits, 12 rounds, ``log-to=tensorboard``.
2. ``fededge plot --sweep`` -> ``docs/figures/sweep.png``.
3. ``tensorboard --logdir <sweep>/runs`` on a free local port, and Chromium headless
   (``--screenshot``) of its scalars dashboard -> ``docs/figures/tensorboard-scalars.png``.
   The server is stopped afterwards, whatever happens.

    python scripts/docs_tracking_figures.py [--out DIR] [--chromium /usr/bin/chromium]

Needs the tracking extra (``pip install 'fededge[tensorboard]'``) and Chromium (Debian:
``apt install chromium``).
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "figures"), help="where the PNGs go")
    p.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser") or "chromium")
    p.add_argument("--sweep-dir", default=None, help="keep the sweep here (default: a temporary directory)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.sweep_dir) if args.sweep_dir else Path(tempfile.mkdtemp(prefix="fededge-docs-"))
    sweep = work / "sweep"
    subprocess.run([sys.executable, "-m", "fededge.cli", "sweep", "--grid", "compressor=none,onebit",
                    "--seeds", "0", "1", "--num-clients", "10", "--out", str(sweep), "--run-config",
                    "model='mlp' num-rounds=12 error-feedback=true log-to='tensorboard' netem='4g' "
                    "sim-step-s=0.01 save-model=false"], check=True)
    subprocess.run([sys.executable, "-m", "fededge.cli", "plot", "--sweep", str(sweep), "-o", str(out / "sweep.png"),
                    "--title", "digits, MLP, 10 clients, 4g: uncompressed vs 1-bit + EF, 2 seeds"], check=True)
    port = _free_port()
    tb = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(sweep / "runs"),
                           "--host", "127.0.0.1", "--port", str(port), "--reload_interval", "0"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    profile = Path(tempfile.mkdtemp(prefix="fededge-chromium-"))
    try:
        url = f"http://127.0.0.1:{port}/"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url + "data/runs", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline or tb.poll() is not None:
                    raise SystemExit(f"tensorboard did not start on port {port}")
                time.sleep(0.5)
        shot = out / "tensorboard-scalars.png"
        subprocess.run([args.chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                        "--no-first-run", "--disable-background-networking", "--disable-component-update",
                        "--disable-sync", "--hide-scrollbars", f"--user-data-dir={profile}",
                        "--window-size=1500,1000", "--virtual-time-budget=20000", f"--screenshot={shot}",
                        f"{url}?darkMode=false#scalars&tagFilter=accuracy%7Ccum_bytes_up%7Csim_s"],
                       check=True, timeout=180, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"wrote {out / 'sweep.png'} and {shot}")
    finally:
        tb.terminate()
        try:
            tb.wait(10)
        except subprocess.TimeoutExpired:
            tb.kill()
        shutil.rmtree(profile, ignore_errors=True)
        if not args.sweep_dir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Headless Chromium (Debian's `chromium` package, installed by scripts/setup.sh) for tests that look at
pages the way a user does: a screenshot kept under artifacts/ and the DOM after the page loaded."""

from __future__ import annotations

import shutil
import struct
import subprocess
import tempfile
import zlib
from pathlib import Path

from tests.service.fixtures import unavailable

REPO_ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS_DIR = REPO_ROOT / "artifacts"  # gitignored; CI can upload it
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        unavailable("chromium is not installed (scripts/setup.sh installs it: apt-get install -y chromium)")
    return path


def _run(url: str, *flags: str, timeout: float = 90) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="freight-chromium-") as profile:
        return subprocess.run(
            [chromium(), *FLAGS, f"--user-data-dir={profile}", *flags, url],
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def screenshot(url: str, name: str, width: int = 1280, height: int = 1600) -> Path:
    """Save a screenshot of `url` as artifacts/<name> and return its path."""
    ARTIFACTS_DIR.mkdir(exist_ok=True)
    path = ARTIFACTS_DIR / name
    path.unlink(missing_ok=True)
    result = _run(
        url, f"--screenshot={path}", f"--window-size={width},{height}", "--virtual-time-budget=5000"
    )
    assert path.is_file(), f"chromium wrote no screenshot:\n{result.stderr[-3000:]}"
    return path


def dump_dom(url: str) -> str:
    """The page's DOM as serialized after it loaded (scripts run)."""
    result = _run(url, "--dump-dom", "--virtual-time-budget=5000")
    assert result.returncode == 0 and "<html" in result.stdout, result.stderr[-3000:]
    return result.stdout


def png_colors(path: Path) -> int:
    """How many distinct byte values the decoded pixel rows hold: about 1-3 for a blank page,
    hundreds for a rendered one."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    offset, compressed = 8, b""
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind = data[offset + 4 : offset + 8]
        if kind == b"IDAT":
            compressed += data[offset + 8 : offset + 8 + length]
        offset += 12 + length
    return len(set(zlib.decompress(compressed)))

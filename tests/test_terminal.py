"""What a user's terminal shows during a fit with the tuner, under Lightning's tqdm bar and its Rich bar: the fit runs
in a pseudo-terminal and its output is rendered by a terminal emulator (``pyte``), so the assertions are on the
screen the user reads, not on the bytes (a bar redraws in place with carriage returns and escape sequences)."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

pyte = pytest.importorskip("pyte")

SCRIPT = Path(__file__).parent / "terminal_fit.py"


def screen_of(bar: str, columns: int, tmp_path: Path) -> list[str]:
    """The lines on a ``columns``-wide terminal once the fit under ``bar`` ended (trailing blank lines cut)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 500, columns, 0, 0))
    env = {**os.environ, "COLUMNS": str(columns), "LINES": "500", "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), bar, str(tmp_path)], stdin=slave, stdout=slave, stderr=slave, env=env
    )
    os.close(slave)
    out, deadline = b"", time.monotonic() + 240
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            out += data
        elif proc.poll() is not None:
            break
    os.close(master)
    assert proc.wait(timeout=30) == 0, out.decode(errors="replace")[-3000:]
    screen = pyte.Screen(columns, 500)
    pyte.ByteStream(screen).feed(out)
    lines = [line.rstrip() for line in screen.display]
    while lines and not lines[-1]:
        lines.pop()
    return lines


@pytest.mark.parametrize(("bar", "columns"), [("tqdm", 100), ("rich", 150)])
def test_every_line_of_the_tuner_starts_on_its_own_line_and_the_bars_redraw_in_place(bar, columns, tmp_path):
    lines = screen_of(bar, columns, tmp_path)
    shown = "\n".join(lines)
    ours = [line for line in lines if "lightning_ckpt:" in line]
    # Not glued to a bar ("...0/2 [00:00<?, ?it/s]lightning_ckpt: chose ...") nor to another line.
    assert ours and all(line.startswith("lightning_ckpt:") for line in ours), shown
    assert any(line.startswith("lightning_ckpt: chose ") for line in ours), shown
    # The tuner's bar redrew in place and was erased when the search ended: none of its frames is left on screen.
    assert not [line for line in ours if line.startswith(("lightning_ckpt: tuning:", "lightning_ckpt: confirming:"))]
    # Lightning's bar is drawn once, at its end: not left frozen above the search, nor redrawn during it.
    epochs = [line for line in lines if line.startswith("Epoch ")]
    assert len(epochs) == 1 and ("2/2" in epochs[0]), shown
    assert any(line.startswith("`Trainer.fit` stopped") for line in lines), shown
    chose = next(i for i, line in enumerate(lines) if line.startswith("lightning_ckpt: chose "))
    assert chose < lines.index(epochs[0]), "the result line comes before the bar's last frame, not inside it"

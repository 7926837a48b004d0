"""What a user's terminal shows during a fit with the tuner, under Lightning's tqdm bar and its Rich bar: the fit runs
in a pseudo-terminal and its output is rendered by a terminal emulator (``pyte``), so the assertions are on the
screen the user reads, not on the bytes (a bar redraws in place with carriage returns and escape sequences)."""

from __future__ import annotations

import fcntl
import os
import pty
import re
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


def screen_of(bar: str, columns: int, tmp_path: Path, *extra: str) -> list[str]:
    """The lines on a ``columns``-wide terminal once the fit under ``bar`` ended (trailing blank lines cut)."""
    out = output_of(bar, columns, tmp_path, *extra)
    screen = pyte.Screen(columns, 500)
    pyte.ByteStream(screen).feed(out)
    lines = [line.rstrip() for line in screen.display]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def output_of(bar: str, columns: int, tmp_path: Path, *extra: str) -> bytes:
    """Every byte the fit under ``bar`` wrote to a ``columns``-wide pseudo-terminal."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 500, columns, 0, 0))
    env = {**os.environ, "COLUMNS": str(columns), "LINES": "500", "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), bar, str(tmp_path), *extra], stdin=slave, stdout=slave, stderr=slave, env=env
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
    return out


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


def test_the_bar_moves_with_every_round_of_the_confirmation(tmp_path):
    # Issue #64: the last frame `confirming: 6plan [02:53, 16.50s/plan, ...]` was drawn twice and did not move for the
    # 8.6 minutes the rounds took: the run looked hung. Every frame the terminal was sent, in order.
    out = output_of("tqdm", 200, tmp_path, "confirm").decode(errors="replace")
    frames = [
        f for f in re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", out)) if "lightning_ckpt: confirming:" in f
    ]
    rounds = [m.group(1, 2, 3) for f in frames if (m := re.search(r"round (\d+) of at most (\d+): (\d+)/\d+ plans", f))]
    assert len(rounds) >= 6, frames
    assert {r for r, _, _ in rounds} >= {"1", "2", "3", "4"} and {m for _, m, _ in rounds} == {"4"}, rounds
    assert len({t for _, _, t in rounds}) >= 2, "the line moves within a round, with each plan timed"
    assert any(re.search(r"; leader \d+\.\d+x \[\d+\.\d+, \d+\.\d+\] vs ", f) for f in frames), frames[-3:]
    assert len(set(frames)) == len(frames) or len(set(frames)) >= 6, "each redraw shows something new"

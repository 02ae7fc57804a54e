"""Progress on rank 0 (pricer/progress.py) through real `mpiexec -n 3 pricer price` runs on real files:
log lines on a pipe, fed by every rank and ending at 100 %; a tqdm bar on a terminal (a pty, through
mpiexec's forwarding); nothing with --quiet; the summary on stdout still parses for `pricer scaling`.
The three runs go concurrently, to keep the added test time to a few seconds."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import subprocess
import time

import numpy as np
import pytest

from helpers import env, mpiexec, pricer_command
from pricer.io.portfolio import Portfolio, write_portfolio
from pricer.run.progress import choose_mode, period, progress_line

RANKS = 3
LINE = re.compile(r"^pricer: progress (\d+)% \((\S+) of (\S+) nodes, (\d+) of (\d+) chunks, "
                  r"(\S+) nodes/s, (eta .+|in [\d.]+ s)\)$")


def make_book(n: int = 150, seed: int = 5) -> Portfolio:
    rng = np.random.default_rng(seed)
    return Portfolio(
        id=np.arange(n, dtype=np.int64), spot=rng.uniform(80, 120, n),
        strike=rng.uniform(80, 120, n), maturity=rng.uniform(0.25, 2, n),
        rate=rng.uniform(0, 0.06, n), dividend=rng.uniform(0, 0.03, n),
        volatility=rng.uniform(0.15, 0.5, n), steps=rng.integers(3, 200, n),
        call=rng.random(n) < 0.5, american=rng.random(n) < 0.5)


def _command(book, out, *extra):
    return [mpiexec(), "-n", str(RANKS)] + pricer_command() + [
        "price", str(book), "-o", str(out), "--chunk-nodes", "2e4", "--threads", "1", *extra]


def _env(**extra):
    e = env()
    e.pop("PRICER_PROGRESS", None)
    e.update(PRICER_PROGRESS_SECONDS="0.1", PRICER_CHUNK_DELAY="0.03", **extra)
    return e


def _read_pty(master: int, proc: subprocess.Popen, timeout: float) -> bytes:
    data, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:   # EIO: every writer closed the terminal
                break
            if not chunk:
                break
            data += chunk
        elif proc.poll() is not None:
            break
    return data


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same book priced three ways at once: stderr a pipe, --quiet, and on a terminal (pty)."""
    tmp = tmp_path_factory.mktemp("progress")
    book = tmp / "book.h5"
    write_portfolio(str(book), make_book())
    pipe = subprocess.Popen(_command(book, tmp / "pipe.h5"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())
    quiet = subprocess.Popen(_command(book, tmp / "quiet.h5", "--quiet"), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=_env())
    master, slave = pty.openpty()
    try:
        import fcntl
        import struct
        import termios
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))
        tty = subprocess.Popen(_command(book, tmp / "tty.h5"), stdin=slave, stdout=slave,
                               stderr=slave, env=_env(), start_new_session=True)
    finally:
        os.close(slave)
    try:
        screen = _read_pty(master, tty, timeout=120).decode("utf-8", "replace")
        tty.wait(timeout=30)
    finally:
        os.close(master)
    out = {}
    for name, proc in (("pipe", pipe), ("quiet", quiet)):
        stdout, stderr = proc.communicate(timeout=120)
        out[name] = (proc.returncode, stdout, stderr)
    out["tty"] = (tty.returncode, screen, "")
    return out


def test_log_lines_fed_by_every_rank(runs):
    rc, stdout, stderr = runs["pipe"]
    assert rc == 0, stdout + stderr
    lines = [line for line in stderr.splitlines() if line.startswith("pricer: progress")]
    parsed = [LINE.match(line) for line in lines]
    assert len(lines) >= 3 and all(parsed), stderr
    percents = [int(m.group(1)) for m in parsed]
    chunks = [int(m.group(4)) for m in parsed]
    total = int(parsed[-1].group(5))
    assert percents == sorted(percents) and chunks == sorted(chunks), lines
    assert percents[-1] == 100 and chunks[-1] == total and percents[:-1] and max(percents[:-1]) < 100
    assert parsed[-1].group(7).startswith("in ") and all(m.group(7).startswith("eta ")
                                                         for m in parsed[:-1]), lines
    # every rank's chunks are counted: the last line has them all, and the chunk grid's total is
    # well above what one rank prices (~40 chunks of 2e4 nodes over 3 ranks)
    assert total >= 3 * RANKS, lines
    # stdout: the summary alone, as `pricer scaling` parses it
    assert "pricer: progress" not in stdout
    summary = re.search(r"^priced (\d+) options \(([\d.e+]+) nodes\) on (\d+) rank", stdout, re.M)
    assert summary and int(summary.group(1)) == 150 and int(summary.group(3)) == RANKS, stdout
    assert "stages: " in stdout and "compute" in stdout, stdout
    assert float(parsed[-1].group(2)) == pytest.approx(float(summary.group(2)), rel=0.05)


def test_quiet_prints_nothing(runs):
    rc, stdout, stderr = runs["quiet"]
    assert rc == 0 and stdout == "" and stderr == "", (stdout, stderr)


def test_bar_on_a_terminal(runs):
    rc, screen, _ = runs["tty"]
    assert rc == 0, screen
    assert "pricer: progress" not in screen, screen      # a bar, not log lines
    # tqdm frames, each drawn over the last with a carriage return
    frames = re.findall(r"\rpricer: +\d+%\|[^\r\n]*?chunks\]", screen)
    assert len(frames) >= 2 and "100%|" in frames[-1] and "node/s" in frames[-1], screen
    final = re.search(r"(\d+)/(\d+) chunks\]", frames[-1])
    assert final.group(1) == final.group(2), frames[-1]
    assert all(len(f) - 1 <= 100 for f in frames), frames  # the width of mpiexec's terminal
    # mpiexec forwards rank 0's stdout and stderr apart, so under load the summary may come
    # between two frames: only its presence is checked
    assert re.search(r"priced 150 options .* on 3 rank\(s\)", screen), screen


# ------------------------------------------------------------------------------- no MPI needed

def test_progress_line_format():
    line = progress_line(1.2e12, 3.3e12, 412, 1100, 1.2e12 / 9.1e11)
    assert line == ("pricer: progress 36% (1.2e12 of 3.3e12 nodes, 412 of 1100 chunks, "
                    "9.1e11 nodes/s, eta 2 s)")
    assert LINE.match(line)
    # 100 % only once every chunk is in; the last line says how long it took
    assert progress_line(3.3e12 - 1, 3.3e12, 1099, 1100, 10.0).startswith("pricer: progress 99% ")
    assert progress_line(3.3e12, 3.3e12, 1100, 1100, 12.34).endswith("2.7e11 nodes/s, in 12.3 s)")
    assert "eta 2m00s" in progress_line(1e6, 2e6, 1, 2, 120.0)
    assert "eta 1h00m" in progress_line(1e6, 2e6, 1, 2, 3600.0)
    assert "eta ?" in progress_line(0, 2e6, 0, 2, 1.0)
    assert "(0 of 1500 nodes" in progress_line(0, 1500, 0, 2, 1.0)


def test_mode_and_period_from_environment():
    stream = io.StringIO()   # not a terminal
    assert choose_mode(stream, {"PRICER_PROGRESS": "off"}) == ("off", None)
    assert choose_mode(stream, {"PRICER_PROGRESS": "log"}) == ("log", None)
    assert choose_mode(stream, {"PRICER_PROGRESS": "bar"})[0] == "bar"
    assert period({}) == 10.0 and period({"PRICER_PROGRESS_SECONDS": "0.5"}) == 0.5
    assert period({"PRICER_PROGRESS_SECONDS": "x"}) == 10.0
    assert period({"PRICER_PROGRESS_SECONDS": "-1"}) == 10.0

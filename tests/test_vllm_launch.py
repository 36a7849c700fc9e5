"""tests/vllm_driver.launch removes what a launch's ranks left in /dev/shm, those of a rank that
never reached its own end included, and nothing else (no vLLM needed: a stand-in torchrun)."""
import os
import stat
import uuid
from pathlib import Path

import pytest

from vllm_driver import SEGMENTS, TAG, launch

pytestmark = pytest.mark.skipif(not SEGMENTS.is_dir(), reason="no /dev/shm")


def test_a_killed_ranks_segments_are_removed_and_no_other(tmp_path):
    bin_ = tmp_path / "venv" / "bin"
    bin_.mkdir(parents=True)
    torchrun = bin_ / "torchrun"  # both ranks name a segment; rank 1 is killed before its end
    torchrun.write_text(f'#!/bin/sh\ntouch "{SEGMENTS}/${{{TAG}}}-cpushm_0" "{SEGMENTS}/${{{TAG}}}-cpushm_1"\n'
                        f'echo "$@" > "{tmp_path}/argv"\nkill -9 $$\n')
    torchrun.chmod(torchrun.stat().st_mode | stat.S_IXUSR)
    other = SEGMENTS / f"dtpshard-vllm-{uuid.uuid4().hex[:12]}-cpushm_0"  # another launch's, still running
    other.touch()
    try:
        before = set(SEGMENTS.iterdir())
        done = launch(bin_ / "python", tmp_path / "specs.json", tmp_path / "out.json", world=2, env=dict(os.environ))
        assert done.returncode == -9
        assert set(SEGMENTS.iterdir()) <= before and other.exists()
        argv = (tmp_path / "argv").read_text().split()
        assert argv[:4] == ["--standalone", "--nproc-per-node", "2", str(Path(__file__).with_name("vllm_driver.py"))]
    finally:
        other.unlink(missing_ok=True)

"""Where dtpshard keeps what it makes once and reuses (the parsed offline corpus, the dequantised demo
model, the native kernels, the vLLM environment, lm-eval's task files), and whether a folder is fit
to hold code this user will run."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from dtpshard.core.errors import UserError


def cache_dir() -> Path:
    """dtpshard's one cache folder (the parsed offline corpus, the dequantised demo model, the native
    kernels, the vLLM environment): $DTPSHARD_CACHE, else $XDG_CACHE_HOME/dtpshard, else
    ~/.cache/dtpshard. A relative path would name a folder under whatever directory the command runs in,
    which anyone may have shipped: a relative $XDG_CACHE_HOME is ignored, as the XDG specification says,
    and a relative $DTPSHARD_CACHE, set for dtpshard alone, is refused in one line (a ~nobody too)."""
    setting = os.environ.get("DTPSHARD_CACHE", "")
    if setting:
        path = os.path.expanduser(setting)
        if path.startswith("~"):
            raise UserError(f"environment variable DTPSHARD_CACHE={setting[:200]!r}: names a user that does not "
                            "exist; give an absolute path")
        if not os.path.isabs(path):
            raise UserError(f"environment variable DTPSHARD_CACHE={setting[:200]!r}: is a relative path, which "
                            "would run code from whatever folder the command starts in; give an absolute path")
        return Path(os.path.abspath(path))
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "dtpshard"


def private_dir(d: Path) -> str:
    """Make folder `d` (mode 0700 where missing) and say why it cannot hold what this user runs
    ("" if it can): a cache entry that is code is trusted only in an absolute, real folder of this
    user that no one else may write, under folders that only this user or root may change (else
    anyone who can write there chooses the code, or swaps a folder on the way for one of theirs)."""
    d = Path(d)
    if not d.is_absolute():
        return f"{d} is not an absolute path"
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = os.lstat(d)
    except OSError as e:
        return f"cannot make {d} ({(e.strerror or str(e)).lower()})"
    if not stat.S_ISDIR(st.st_mode):
        return f"{d} is not a directory (a symbolic link?)"
    if st.st_uid != os.geteuid():
        return f"{d} belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o022:
        return f"{d} may be written by other users (mode {stat.S_IMODE(st.st_mode):o})"
    for up in d.parents:  # a folder on the way is followed as it is (a link to a root-owned /data is fine)
        try:
            st = os.stat(up)
        except OSError as e:
            return f"cannot read {up} ({(e.strerror or str(e)).lower()})"
        if st.st_uid not in (0, os.geteuid()):
            return f"{up}, a folder on the way to {d}, belongs to another user (uid {st.st_uid})"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:  # /tmp's sticky bit: others cannot swap ours
            return (f"{up}, a folder on the way to {d}, may be written by other users "
                    f"(mode {stat.S_IMODE(st.st_mode):o})")
    return ""

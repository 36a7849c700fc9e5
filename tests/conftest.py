import atexit
import os
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir

sys.path.insert(0, str(Path(__file__).parent))
# every process the tests start imports this checkout and the test-only fault hooks (hooks/sitecustomize.py)
os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), str(Path(__file__).parent / "hooks"),
                                            *filter(None, [os.environ.get("PYTHONPATH")])])
torch.set_num_threads(1)  # tiny models: more threads only add contention
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every process the tests start keeps its temporaries in this session's directory, removed when the
# session ends: torchrun's torchelastic_* logs, vLLM's init files, what a launcher killed outright
# leaves, and transformers' modules cache (a student's remote code, copied when transformers is
# imported; never ~/.cache/huggingface/modules). This process keeps the system's (tempfile's choice,
# made first), where pytest's tmp_path lives and stays for a failure's debugging. Inductor's compile
# cache stays where torch keeps it: shared by every process and run, as it is outside the tests.
tempfile.gettempdir()
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache_dir())
_SESSION = tempfile.mkdtemp(prefix="dtpshard-tests-")
atexit.register(shutil.rmtree, _SESSION, ignore_errors=True)
os.environ["TMPDIR"] = _SESSION
os.environ["HF_MODULES_CACHE"] = os.path.join(_SESSION, "hf-modules")
os.mkdir(os.environ["HF_MODULES_CACHE"])
import transformers  # noqa: E402

transformers.utils.logging.disable_progress_bar()


# Files whose engines take minutes on one worker go first, one to each worker, the rest by test count
# (pyproject's --no-loadscope-reorder keeps this order): xdist's own order, by count, left them to
# one worker at the end while the other sat idle.
FIRST = ("test_vllm.py", "test_vllm_server.py", "test_vllm_shared.py")


def _first_the_long_files(items):
    count = Counter(item.path.name for item in items)
    items.sort(key=lambda item: (FIRST.index(item.path.name) if item.path.name in FIRST else len(FIRST),
                                 -count[item.path.name], item.path.name))


def pytest_collection_modifyitems(config, items):
    _first_the_long_files(items)
    if os.environ.get("DTPSHARD_SLOW") == "1":
        for item in items:  # real-model and compile tests run for minutes on a small CPU
            if "slow" in item.keywords:
                item.add_marker(pytest.mark.timeout(3600))
        return
    skip = pytest.mark.skip(reason="slow: set DTPSHARD_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    """A test run never waits on a process a test left behind: multiprocessing joins every child it
    started when the interpreter exits, so one rank stuck in its teardown would hold the run forever."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.kill()
        child.join(10)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """One saved tiny checkpoint per family, built once per test session."""
    from tiny import FAMILIES, save_tiny

    root = tmp_path_factory.mktemp("tiny")
    return {f: save_tiny(root / f, f) for f in FAMILIES}

"""Test-only faults, kept out of dtpshard: every Python process the tests start (subprocesses,
`--nproc` ranks) has tests/hooks on PYTHONPATH (conftest.py), so this runs at its start. When
dtpshard's modules are imported they are wrapped so that, while the environment asks for it, a
process dies like a SIGKILL (os._exit, no cleanup) at a named point:

  DTPSHARD_TEST_CRASH=step:K[@RANK]        right after optimizer step K (before its metrics row), exit 17
  DTPSHARD_TEST_CRASH=checkpoint:K[@RANK]  after checkpoint K is written to its temporary, before the rename
                                           (--fsdp: rank 0 dies; the shards of every rank are written)
  DTPSHARD_TEST_KILL=RANK:M                that runtime rank dies at module M of its forward, exit 3
"""
import importlib.abc
import importlib.util
import os
import sys


def _crash_wanted(point, step):
    want = os.environ.get("DTPSHARD_TEST_CRASH", "")
    rank = os.environ.get("RANK", "0")
    return want in (f"{point}:{step}", f"{point}:{step}@{rank}")


def _patch_loop(mod):
    lr_factor = mod.lr_factor

    def dying(i, *args):  # the scheduler asks for step i + 1's rate right after optimizer step i
        if i > 0 and _crash_wanted("step", i):
            os._exit(17)
        return lr_factor(i, *args)

    mod.lr_factor = dying


def _patch_rundir(mod):
    import torch

    save = mod.save_checkpoint

    def save_checkpoint(run, state):
        if not _crash_wanted("checkpoint", state["step"]):
            return save(run, state)
        with mod.atomic_path(run / mod.CHECKPOINT) as tmp:
            torch.save(state, tmp)
            os._exit(17)  # a complete temporary file that was never renamed

    mod.save_checkpoint = save_checkpoint


def _patch_fsdp(mod):
    publish = mod.publish

    def dying(run, tmp, final):
        if _crash_wanted("checkpoint", int(final.name.split("-")[1])):
            os._exit(17)  # every rank's shards written to the temporary directory, never renamed
        return publish(run, tmp, final)

    mod.publish = dying


def _patch_ranks(mod):
    cls = mod.RankModel
    method = cls.module_partials

    def dying(self, m, *args, **kwargs):
        kill = os.environ.get("DTPSHARD_TEST_KILL", "")
        if kill and int(kill.split(":")[0]) == self.rank and int(kill.split(":")[1]) == m:
            os._exit(3)  # dies mid-forward without a word
        return method(self, m, *args, **kwargs)

    cls.module_partials = dying


PATCHES = {"dtpshard.training.loop": _patch_loop, "dtpshard.training.rundir": _patch_rundir,
           "dtpshard.training.fsdp": _patch_fsdp, "dtpshard.runtime.ranks": _patch_ranks}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def patched(module):
            exec_module(module)
            PATCHES[name](module)

        spec.loader.exec_module = patched
        return spec


sys.meta_path.insert(0, _Finder())

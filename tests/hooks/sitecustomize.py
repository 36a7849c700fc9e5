"""Test-only faults, kept out of dtpshard: every Python process the tests start (subprocesses,
`--nproc` ranks) has tests/hooks on PYTHONPATH (conftest.py), so this runs at its start. When
dtpshard's modules are imported they are wrapped so that, while the environment asks for it, a
process dies like a SIGKILL (os._exit, no cleanup) at a named point:

  DTPSHARD_TEST_CRASH=step:K[@RANK]        right after optimizer step K (before its metrics row), exit 17
  DTPSHARD_TEST_CRASH=checkpoint:K[@RANK]  after checkpoint K is written to its temporary, before the rename
                                           (--fsdp: rank 0 dies; the shards of every rank are written)
  DTPSHARD_TEST_KILL=RANK:M                that runtime rank dies at module M of its forward, exit 3

and, for `convert`, by a real SIGKILL, once in each stage:

  DTPSHARD_TEST_CRASH=affinity             after the affinity file is written to its temporary, before the rename
  DTPSHARD_TEST_CRASH=layout               likewise for a layout file
  DTPSHARD_TEST_CRASH=checkpointed:K       right after checkpoint K is published
  DTPSHARD_TEST_CRASH=final                right after the run's final/ (the student) is published, before DONE
  DTPSHARD_TEST_CRASH=student              halfway through publishing convert's DIR/student (one file placed)

and, so that a test signals a process at a known moment instead of after a guessed delay:

  DTPSHARD_TEST_PAUSE=calibration          convert's stage 1 prints "paused" on stderr and waits (up to
                                           two minutes) for a signal, whose handler ends the wait
  DTPSHARD_TEST_PAUSE=summary              likewise once every stage is done, before convert's summary
"""
import importlib.abc
import importlib.util
import os
import signal
import sys


def _crash_wanted(point, step):
    want = os.environ.get("DTPSHARD_TEST_CRASH", "")
    rank = os.environ.get("RANK", "0")
    return want in (f"{point}:{step}", f"{point}:{step}@{rank}")


def _sigkill(point):
    if os.environ.get("DTPSHARD_TEST_CRASH", "") == point:
        os.kill(os.getpid(), signal.SIGKILL)


def _patch_loop(mod):
    lr_factor = mod.lr_factor

    def dying(i, *args):  # the scheduler asks for step i + 1's rate right after optimizer step i
        if i > 0 and _crash_wanted("step", i):
            os._exit(17)
        return lr_factor(i, *args)

    mod.lr_factor = dying
    save_student = mod._save_student

    def _save_student(run, *args, **kwargs):
        save_student(run, *args, **kwargs)
        _sigkill("final")

    mod._save_student = _save_student


def _patch_rundir(mod):
    import torch

    save = mod.save_checkpoint

    def save_checkpoint(run, state):
        if not _crash_wanted("checkpoint", state["step"]):
            save(run, state)
            _sigkill(f"checkpointed:{state['step']}")
            return None
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


def _patch_io(mod):
    publish_new = mod.publish_new
    names = {"affinity": "affinity.safetensors", "layout": "layout.json"}

    def dying(tmp, path):
        if names.get(os.environ.get("DTPSHARD_TEST_CRASH", "")) == os.path.basename(path):
            os.kill(os.getpid(), signal.SIGKILL)  # the temporary is whole, never renamed
        return publish_new(tmp, path)

    mod.publish_new = dying


def _patch_convert(mod):
    place, calls = mod._place, []

    def dying(src, dst):
        place(src, dst)
        calls.append(dst)
        if len(calls) == 2:
            _sigkill("student")

    mod._place = dying
    mod.summary = _pausing("summary", mod.summary)


def _pausing(point, fn):
    def paused(*args, **kwargs):
        if os.environ.get("DTPSHARD_TEST_PAUSE") == point:
            import time

            print("paused", file=sys.stderr, flush=True)
            for _ in range(2400):  # a signal's handler raises out of the sleep (no race, as pause() has)
                time.sleep(0.05)
        return fn(*args, **kwargs)

    return paused


def _patch_calibrate(mod):
    mod.run_calibration = _pausing("calibration", mod.run_calibration)


PATCHES = {"dtpshard.affinity.calibrate": _patch_calibrate,
           "dtpshard.training.loop": _patch_loop, "dtpshard.training.rundir": _patch_rundir,
           "dtpshard.training.fsdp": _patch_fsdp, "dtpshard.runtime.ranks": _patch_ranks,
           "dtpshard.core.io": _patch_io, "dtpshard.training.convert": _patch_convert}


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

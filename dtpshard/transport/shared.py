"""The one-sided exchange for ranks on one host: a Reduce (model/exchange.py) over shared memory.

DTP needs no collective. After module m a rank only has to leave its partial where its peers can
read it, and it needs theirs δ modules later. So:

- `start(p)` writes p into this rank's own slot of a shared ring and publishes the sum's sequence
  number. It never waits for a peer, only for ring space (back-pressure, below).
- `value(token)` waits until every peer has published that sequence number, then sums the slots in
  rank order: the same bits on every rank.

Sums are numbered in the order they are started, which the schedule makes the same on every rank.
The ring has one slot more than the most sums the schedule keeps in flight (`ring_slots`). Each
rank records the last sum it has read in each slot, and a writer about to reuse a slot waits until
every rank has read the slot's previous sum: a writer faster than its readers never overwrites an
unread partial.

Both halves are torch custom ops (`dtpshard::exchange_start`, `dtpshard::exchange_value`, defined
in transport/ops.py), opaque to Dynamo and Inductor, so a compiled forward keeps each where the
exchange put it. Their kernels are native (transport/ring.cpp, built by transport/native.py)
where a C++ compiler is found, and this file's Python otherwise: the native kernels call back
into it for what is rare (a message over a slot, a wait that outlasts the spin, a dead peer), so
the rules are written here once. The counter of sums started and the emulated latency live in
the segment, in this rank's own words, so both kernels read the same.

The segment is a file in /dev/shm made by the group's first rank, mapped by every rank and unlinked
as soon as all have mapped it: from then on no exit path (an error, SIGTERM, SIGKILL) can leave it
behind. A segment left by a run killed during those few milliseconds is removed by the next run
(its creator's pid is in its name). A message larger than a slot (a long prefill) is summed by
the group's own blocking all-reduce instead, on every rank alike, since the sizes are the same.

A peer that dies, ends or stops sending is noticed while waiting on it: one RankFailure line
naming it, within about 10 ms of its death (its pid is checked) or the timeout (a hang).

Memory order: x86-64 keeps stores in program order (TSO), so a partial's bytes are visible before
the sequence number stored after them. Other processors take the collective (transport/choose.py).
"""
from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import re
import secrets
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from dtpshard.core.errors import UserError
from dtpshard.core.io import pid_alive, read_text
from dtpshard.core.launch import RankFailure
from dtpshard.transport import native
from dtpshard.transport.ops import RINGS, python_kernels

SEGMENTS = Path("/dev/shm")
NAME = re.compile(r"^dtpshard-exchange-(?P<pid>\d+)-[0-9a-f]{16}$")  # <creator's pid>-<random>
ALIGN = 64  # a slot starts on its own cache line
WORDS = 4  # int64 words per (slot, rank): sum published, sum last read, when published (ns), spare
PUBLISHED, READ, AT = 0, 1, 2
RANK_WORDS = 4  # int64 words per rank after the slots': its pid, its state, and two only it uses:
PID, STATE, ISSUED, LATENCY_NS = 0, 1, 2, 3  # the sums it started, its emulated latency (ns)
RUNNING, CLOSED = 0, 1  # a rank's state word


def ring_slots(schedule) -> int:
    """One more than the most sums `schedule` (model/delay.py) keeps started and not yet taken. A sum
    is taken at its first landing (the exchange keeps it for a fractional δ's second), and its
    slot is free once every rank has taken it."""
    pending: set[int] = set()
    most = 1
    for m in range(len(schedule)):
        if m in schedule.last_use or schedule.tensor_parallel:
            pending.add(m)
            most = max(most, len(pending))
        pending -= {k for k, _ in schedule[m].arrivals}
    return most + 1


def remove_leftovers() -> list[Path]:
    """Remove the segments of runs whose creator has died (killed before every rank mapped it)."""
    gone = []
    for f in SEGMENTS.glob("dtpshard-exchange-*") if SEGMENTS.is_dir() else ():
        m = NAME.match(f.name)
        if m and not pid_alive(int(m["pid"])):
            try:
                f.unlink()
                gone.append(f)
            except OSError:
                pass
    return gone


class SharedRing:
    """This rank's view of one shared segment: `slots` × ranks slots of `capacity` bytes."""

    def __init__(self, path: Path, rank: int, world: int, slots: int, capacity: int, timeout: float,
                 group: dist.ProcessGroup | None, latency: float = 0.0, key: str = ""):
        self.rank, self.world, self.slots, self.capacity = rank, world, slots, capacity
        self.timeout, self.group, self.key = timeout, group, key
        self.header = header_bytes(slots, world)
        fd = os.open(path, os.O_RDWR)
        try:
            self.mm = mmap.mmap(fd, self.header + slots * world * capacity)
        finally:
            os.close(fd)
        self.words = memoryview(self.mm).cast("q")
        data = torch.frombuffer(self.mm, dtype=torch.uint8, offset=self.header, count=slots * world * capacity)
        self.blocks = data.view(slots, world, capacity)
        self.words[self._rank_word(rank) + PID] = os.getpid()
        self.latency = latency
        self.views: dict[tuple[int, int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self.large: dict[int, torch.Tensor] = {}  # sums of messages over `capacity`, already complete
        self.fallbacks = 0  # how many sums took the group's all-reduce
        atexit.register(_close_at_exit, weakref.ref(self))  # a peer waiting on this rank learns it ended
        self.native, self.native_why = False, "not registered"  # which kernels serve the ops (`register`)

    def register(self) -> None:
        """Make this ring the one the ops find under its key, native kernels included where built."""
        self.native_why = native.why_not(self.timeout)
        self.native = not self.native_why
        RINGS[self.key] = self
        if self.native:
            base = self.blocks.data_ptr() - self.header
            torch.ops.dtpshard.exchange_attach(self.key, base, self.header, self.rank, self.world, self.slots,
                                               self.capacity)
            weakref.finalize(self, torch.ops.dtpshard.exchange_detach, self.key, base)  # before the unmap
        else:
            python_kernels()

    @property
    def issued(self) -> int:
        """The sequence number of the last sum started here."""
        return self.words[self._rank_word(self.rank) + ISSUED]

    @property
    def latency(self) -> float:
        """Seconds until a peer's published sum is visible here (an emulated link; 0: none)."""
        return self.words[self._rank_word(self.rank) + LATENCY_NS] / 1e9

    @latency.setter
    def latency(self, seconds: float) -> None:
        self.words[self._rank_word(self.rank) + LATENCY_NS] = int(seconds * 1e9)

    def _word(self, slot: int, rank: int) -> int:
        return (slot * self.world + rank) * WORDS

    def _rank_word(self, rank: int) -> int:
        return self.slots * self.world * WORDS + RANK_WORDS * rank

    def _views(self, slot: int, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's row, every rank's rows) of a slot, as p's dtype and length: made once per
        size (a view costs more than the copy of a decode step's partial)."""
        key = (slot, p.numel(), p.dtype)
        views = self.views.get(key)
        if views is None:
            if len(self.views) > 4096:  # sizes vary with the batch: bounded, remade when needed
                self.views.clear()
            rows = self.blocks[slot, :, :p.numel() * p.element_size()].view(p.dtype)
            views = self.views[key] = (rows[self.rank], rows)
        return views

    def start(self, p: torch.Tensor) -> int:
        """Publish this rank's partial p -> the sum's sequence number."""
        if self.native:
            return int(torch.ops.dtpshard.exchange_start(p, self.key))
        return self._start(p)

    def value(self, seq: int, like: torch.Tensor) -> torch.Tensor:
        """Σ over the ranks of the partials published as sum `seq` (like: this rank's, for shape and dtype)."""
        if self.native:
            return torch.ops.dtpshard.exchange_value(torch.tensor([seq]), like, self.key)
        return self._value(seq, like)

    def _start(self, p: torch.Tensor) -> int:
        seq = self.words[self._rank_word(self.rank) + ISSUED] = self.issued + 1
        nbytes = p.numel() * p.element_size()
        if nbytes > self.capacity:
            total = p.detach().clone(memory_format=torch.contiguous_format)
            dist.all_reduce(total, group=self.group)
            self.large[seq] = total
            self.fallbacks += 1
            return seq
        slot = seq % self.slots
        if seq > self.slots:  # the slot's previous sum must be read by every rank first
            for r in range(self.world):
                self._wait(self._word(slot, r) + READ, seq - self.slots, r, "read")
        self._views(slot, p)[0].copy_(p.reshape(-1))
        w = self._word(slot, self.rank)
        self.words[w + AT] = time.monotonic_ns()
        self.words[w + PUBLISHED] = seq  # last: a peer that sees it sees the bytes (TSO)
        return seq

    def _value(self, seq: int, like: torch.Tensor) -> torch.Tensor:
        slot = seq % self.slots
        total = self.large.pop(seq, None)
        if total is None:
            latency = self.words[self._rank_word(self.rank) + LATENCY_NS]
            for r in range(self.world):
                if r != self.rank:
                    w = self._word(slot, r)
                    self._wait(w + PUBLISHED, seq, r, "sent")
                    if latency:
                        self._until(self.words[w + AT] + latency)
            total = self._views(slot, like)[1].sum(0).view(like.shape)
        self.words[self._word(slot, self.rank) + READ] = seq
        return total

    def _until(self, ns: int) -> None:
        left = (ns - time.monotonic_ns()) / 1e9
        if left > 0:
            time.sleep(left)

    def _wait(self, i: int, target: int, peer: int, what: str, profiled: bool = True) -> None:
        """Until word i reaches `target`: spin, then yield, then sleep, checking on the peer.
        `profiled`: a range of its own in a profile (not when ring.cpp's wait, already one, calls it)."""
        words = self.words
        if words[i] >= target:
            return
        if peer == self.rank:  # this rank's own unread sum: the ring is smaller than the schedule needs
            raise RuntimeError(f"exchange ring of {self.slots} slots is too small for the sums in flight")
        if not profiled:
            return self._wait_on(i, target, peer, what)
        with _profiled("dtpshard::ring_wait"):  # the profile's wait (bench/profile_vllm.py)
            self._wait_on(i, target, peer, what)

    def _wait_on(self, i: int, target: int, peer: int, what: str) -> None:
        words = self.words
        began = time.monotonic()
        check = began + 0.01
        spins = 0
        while words[i] < target:
            spins += 1
            if spins < 2000:
                os.sched_yield()
                continue
            time.sleep(50e-6)
            now = time.monotonic()
            if now >= check:
                check = now + 0.01
                self._check(peer, target, what, now - began)

    def _check(self, peer: int, seq: int, what: str, waited: float) -> None:
        pid = self.words[self._rank_word(peer) + PID]
        who, before = f"rank {peer}, pid {pid}", f"before it {what} sum #{seq} of the exchange"
        if self.words[self._rank_word(peer) + STATE] == CLOSED:
            raise RankFailure(f"rank {self.rank}: another rank ended ({who}, {before})")
        if not pid_alive(pid):
            raise RankFailure(f"rank {self.rank}: another rank died ({who}, {before})")
        if waited > self.timeout:
            raise RankFailure(f"rank {self.rank}: another rank hung or was stopped ({who}, has not {what} sum #{seq} "
                              f"of the exchange in {self.timeout:g} s)")

    def close(self, wait: bool = True) -> bool:
        """Tell the peers this rank has ended (they stop waiting on it). Nothing is ever in flight."""
        if not self.mm.closed:
            self.words[self._rank_word(self.rank) + STATE] = CLOSED
        return True


def _profiled(name: str):
    """A profiler range where a profiler runs (costs nothing measurable where none does)."""
    return torch.profiler.record_function(name) if torch._C._autograd._profiler_enabled() else contextlib.nullcontext()


def _close_at_exit(ring: weakref.ref) -> None:
    if (r := ring()) is not None:
        r.close()


def header_bytes(slots: int, world: int) -> int:
    n = (slots * world * WORDS + RANK_WORDS * world) * 8
    return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE


def _create(size: int) -> tuple[Path | None, str]:
    """A new segment of `size` zero bytes, its pages reserved now: a full /dev/shm refuses here, not
    later with SIGBUS on a write."""
    remove_leftovers()
    path = SEGMENTS / f"dtpshard-exchange-{os.getpid()}-{secrets.token_hex(8)}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        return None, f"{SEGMENTS} refused a segment ({e.strerror})"
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        path.unlink()
        return None, f"{SEGMENTS} refused {size / 2**20:.0f} MiB ({e.strerror})"
    finally:
        os.close(fd)
    return path, ""


def host_key() -> str:
    """The same on two processes iff they share this host's memory: node name and boot id."""
    try:
        boot = read_text("/proc/sys/kernel/random/boot_id", 64, "the boot id").strip()
    except (OSError, UserError):
        boot = ""
    return f"{os.uname().nodename}/{boot}"


def open_ring(group: dist.ProcessGroup, key: str, slots: int, capacity: int, timeout: float,
              latency: float = 0.0) -> tuple[SharedRing | None, str]:
    """Collective over `group`: -> (this rank's ring, "") on every rank, or (None, why not) on
    every rank. The ring is registered under `key` for the custom ops."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    hosts = [None] * world
    dist.all_gather_object(hosts, host_key(), group=group)
    if len(set(hosts)) > 1:
        return None, f"the {world} ranks are on {len(set(hosts))} hosts"
    capacity = -(-capacity // ALIGN) * ALIGN
    made: list = [None]
    if rank == 0:
        made = [_create(header_bytes(slots, world) + slots * world * capacity)]
    dist.broadcast_object_list(made, src=dist.get_global_rank(group, 0), group=group)
    path, why = made[0]
    ring = None
    if path is not None:
        try:
            ring = SharedRing(path, rank, world, slots, capacity, timeout, group, latency, key)
        except (OSError, ValueError) as e:
            why = f"rank {rank} could not map {path} ({e})"
    whys = [None] * world
    dist.all_gather_object(whys, why, group=group)  # also the barrier: every rank has mapped it
    if rank == 0 and path is not None:
        path.unlink()
    why = next((w for w in whys if w), "")
    if why:
        return None, why
    ring.register()
    return ring, ""


class SharedReduce:
    """The Reduce over a ring: the custom ops while a compiler traces, and eagerly where they are
    native; else the ring's Python directly, which costs less than the dispatcher into Python (the
    same token either way, so a handle may cross a graph break)."""

    transport = "shared memory"

    def __init__(self, ring: SharedRing, key: str):
        self.ring, self.key = ring, key

    @property
    def latency(self) -> float:
        """Seconds between a peer publishing a partial and this rank seeing it (an emulated link)."""
        return self.ring.latency

    @latency.setter
    def latency(self, seconds: float) -> None:
        self.ring.latency = seconds

    def start(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ring.native or torch.compiler.is_compiling():
            return torch.ops.dtpshard.exchange_start(p, self.key), p
        return torch.tensor([self.ring._start(p)], dtype=torch.int64), p

    def value(self, handle: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        token, p = handle
        if self.ring.native or torch.compiler.is_compiling():
            return torch.ops.dtpshard.exchange_value(token, p, self.key)
        return self.ring._value(int(token), p)

    def now(self, p: torch.Tensor) -> torch.Tensor:
        """Σ over the ranks, blocking: a sum that lands where it is made."""
        return self.value(self.start(p))

    def close(self, wait: bool = True) -> bool:
        return self.ring.close(wait)

"""The one cache of load-time measurements: one file format, one lock, one rule for a bad file.

Every measurement the plan takes (the schemes, attention, the small-batch threshold) is a dict of seconds,
stored as one JSON file per entry under $FREIGHT_HOME/calibration:

    {"format": FORMAT, "entry": "<name>", "seconds": {...}, "machine": {...}}

- Keys: `calibration_key` names what a measurement depends on (CPU, ISA tier, torch, threads, the model's
  shapes, the kernels' sources, ...); an entry's file name starts with it, so a change measures again.
- One lock (`.lock` in the folder, fcntl): processes starting together (a worker pool) measure one at a
  time; a process that finds no entry takes the lock, reads again (another may have measured meanwhile)
  and only then measures. Measuring side by side would also slow every measurement down.
- Writes are atomic (a temporary file in the folder, then os.replace): a reader sees the old file or the
  whole new one.
- A file that cannot be used (unreadable, truncated, not this FORMAT, missing a timing the plan needs) is
  ignored: one warning, a new measurement, and the file is overwritten (or removed, when the new
  measurement is not fit to keep). Never a crash.
- A measurement during which other processes used more of the machine than timing.CONTENDED_SHARE serves
  this start only and is not cached.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from kernels import cpu_int8_linear
from kernels._cpu_build import CSRC
from kernels.platform import active_tier, amx_allowed, cpu_info
from worker.engine.config import ModelConfig
from worker.engine.plan.timing import ContentionMeter

log = logging.getLogger(__name__)

FORMAT = 3  # the file format: a file of another format is ignored (and overwritten)
CALIBRATION_VERSION = 2  # bump when a measurement changes meaning: it is part of every key, older entries
# are no longer found (2: the AVX2 small-batch product of 7-bit codes got faster, so where it wins moved)
LOCK_NAME = ".lock"

Seconds = dict[str, float]


@dataclass(frozen=True)
class Measurement:
    seconds: Seconds
    source: Literal["cache", "measured"]
    contended: bool = False  # measured while other processes kept the machine busy (not cached)


def _covers_anything(seconds: Seconds) -> bool:
    return True


@dataclass(frozen=True)
class CacheEntry:
    """One measurement's place in the cache; folder None: nothing is cached (each start measures)."""

    folder: Path | None
    name: str

    @property
    def path(self) -> Path | None:
        return None if self.folder is None else self.folder / f"{self.name}.json"

    def cached(self, covers: Callable[[Seconds], bool] = _covers_anything) -> Seconds | None:
        """The cached seconds, if a usable file covers what is asked; says nothing about a bad file (the
        locked read in `measure` does, once)."""
        seconds, _ = self._read(covers)
        return seconds

    def measure(self, run: Callable[[], Seconds], covers: Callable[[Seconds], bool] = _covers_anything) -> Measurement:
        """The cached seconds, or `run()`'s, measured once however many processes ask at once."""
        if (seconds := self.cached(covers)) is not None:
            return Measurement(seconds, "cache")
        with self._lock():
            seconds, problem = self._read(covers)
            if seconds is not None:  # another process measured while this one waited
                return Measurement(seconds, "cache")
            if problem:
                log.warning("calibration cache %s %s: ignoring it and measuring again", self.path, problem)
            started = time.perf_counter()
            with ContentionMeter() as meter:
                seconds = run()
            log.info("measured %s in %.1fs", self.name, time.perf_counter() - started)
            self._store(seconds, meter, replaces_bad=problem is not None)
        return Measurement(seconds, "measured", contended=meter.contended)

    def write(self, seconds: Seconds) -> None:
        """Store seconds as the entry's file, atomically: readers see the old file or the whole new one."""
        path = self.path
        if path is None:
            return
        payload = {"format": FORMAT, "entry": self.name, "seconds": seconds, "machine": _machine()}
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
        try:
            with os.fdopen(fd, "w") as out:
                json.dump(payload, out, indent=1)
            os.replace(partial, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(partial)
            raise

    def _store(self, seconds: Seconds, meter: ContentionMeter, *, replaces_bad: bool) -> None:
        """Cache a measurement, unless the machine was busy with others while it ran: then it serves this
        start only, and the next start measures again (a bad file it would have replaced goes)."""
        path = self.path
        if path is None:
            return
        if meter.contended:
            log.warning("other processes used %.0f%% of the CPUs during calibration: not caching %s; the next "
                        "start measures again", 100 * meter.others_share, path.name)  # fmt: skip
            if replaces_bad:
                with contextlib.suppress(OSError):
                    path.unlink()
            return
        self.write(seconds)

    def _read(self, covers: Callable[[Seconds], bool]) -> tuple[Seconds | None, str | None]:
        """(seconds, None) for a usable file; (None, why) for a bad one; (None, None) for none."""
        path = self.path
        if path is None:
            return None, None
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None, None
        except (OSError, UnicodeDecodeError) as error:
            return None, f"is unreadable ({error})"
        try:
            payload = json.loads(text)
        except ValueError:
            return None, "is not whole JSON (corrupt or truncated)"
        if not isinstance(payload, dict) or payload.get("format") != FORMAT:
            found = payload.get("format") if isinstance(payload, dict) else None
            return None, f"has format {found!r}, this build reads format {FORMAT}"
        seconds = payload.get("seconds")
        if not isinstance(seconds, dict) or not all(
            isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) for k, v in seconds.items()
        ):
            return None, "holds no table of seconds"
        if not covers(seconds):
            return None, "lacks a timing this plan needs"
        return seconds, None

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        """The cache folder's one lock, held while a process reads again and measures."""
        if self.folder is None:
            yield
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / LOCK_NAME, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def _machine() -> dict[str, object]:
    """Where a measurement was taken (for whoever reads the file; the key already decides reuse)."""
    return {"cpu": cpu_info().model_name, "tier": active_tier(), "torch": torch.__version__,
            "threads": torch.get_num_threads()}  # fmt: skip


_RELEVANT_FLAGS = frozenset({"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16"})


def calibration_key(model: ModelConfig, decode_rows: int, kv_cache_dtype: str = "int8") -> str:
    """What every measurement depends on, hashed: the start of each entry's name."""
    info = cpu_info()
    parts = [CALIBRATION_VERSION, info.model_name, active_tier(), sorted(info.flags & _RELEVANT_FLAGS),
             torch.__version__, torch.get_num_threads(), model.hidden_size, model.intermediate_size,
             model.num_heads, model.num_kv_heads, model.head_dim, model.vocab_size, decode_rows,
             cpu_int8_linear.available(), _kernel_sources_digest(), kv_cache_dtype, amx_allowed()]  # fmt: skip
    if model.num_experts:  # MoE shapes (dense models keep their keys)
        parts += [model.num_experts, model.num_experts_per_tok, model.moe_intermediate_size, model.sparse_layers[:1]]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:20]


@functools.cache
def _kernel_sources_digest() -> str:
    """Changed kernels measure again: the compiled sources are part of the cache key."""
    digest = hashlib.sha256()
    for source in sorted(CSRC.iterdir()):
        digest.update(source.name.encode() + source.read_bytes())
    return digest.hexdigest()[:12]

"""A distributed kernel called from Python on every rank of a communicator (mpi4py).

Before any rank's native code runs, the ranks agree: every rank's arguments are checked
(moagen.targets.abi), then one allgather compares what each rank was given (sizes, scalars,
dtype) and carries any rank's error, so a mismatch or a bad argument on one rank is the same
ValueError on every rank, naming the ranks. Every call that communicates runs under a
deadline: a rank that died or never arrives leaves the others waiting in MPI, where no
timeout exists, so a timer thread reports it on each waiting rank and aborts the job
(MPI_Abort) instead of hanging."""
import os
import sys
import threading
from contextlib import contextmanager

from moagen.errors import MoagenError
from moagen.kernels import get_kernel
from moagen.onf.signature import DTYPE_BYTES
from moagen.ranks import library
from moagen.ranks.mapping import get_rank_kernel

INT_MAX = 2 ** 31 - 1  # MPI counts are C ints
TIMEOUT_EXIT = 124  # the exit status of a job aborted by the deadline, as timeout(1)'s
DEFAULT_TIMEOUT = float(os.environ.get("MOAGEN_MPI_TIMEOUT", "600"))


class RankMismatch(ValueError):
    """The ranks were called with arguments that do not fit together."""


@contextmanager
def deadline(comm, seconds, what):
    """Abort every rank when the block has not finished within `seconds`."""
    def expire():
        sys.stderr.write(f"moagen: rank {comm.Get_rank()} of {comm.Get_size()}: {what} did not "
                         f"finish within {seconds:g} s (another rank died, is stuck, or did not "
                         f"call it); aborting every rank\n")
        sys.stderr.flush()
        comm.Abort(TIMEOUT_EXIT)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


class RankKernel:
    """kernel(*inputs, **scalars) on every rank of `comm`: this rank's blocks in, this rank's
    outputs back (ring_attention_fwd: Q, K, V rows of this rank -> its O, lse rows; the
    sharded decode: q, this rank's cache shard and its count of valid rows -> O, lse of the
    whole cache, on every rank)."""

    def __init__(self, name, lang, dtype, comm, timeout=DEFAULT_TIMEOUT):
        self.mapping = get_rank_kernel(name)
        self.comm, self.timeout = comm, timeout
        self.lang, self.dtype = library.check_lang(lang), dtype
        self._local_validate = get_kernel(self.mapping.local).validate
        self._build_once()
        self._callable = library.bind(self.mapping, lang, dtype, comm.py2f(), comm.Get_size(),
                                      self._agree)
        self._agreed = False

    def _build_once(self):
        """Rank 0 builds the library (or finds it built) while the others wait; then each
        loads it: one compile, not one a rank, and a compile error raised on every rank."""
        error = None
        if self.comm.Get_rank() == 0:
            try:
                library.library(self.mapping, self.lang)
            except MoagenError as e:
                error = f"{type(e).__name__}: {e}"
        # a compile may take long: the deadline here is never shorter than the default's
        with deadline(self.comm, max(self.timeout, DEFAULT_TIMEOUT),
                      f"building {self.mapping.function} ({self.lang})"):
            error = self.comm.bcast(error, root=0)
        if error is not None:
            raise MoagenError(f"{self.mapping.function} ({self.lang}): rank 0 could not build "
                              f"it: {error}")

    def __call__(self, *args, **kwargs):
        self._agreed = False
        with deadline(self.comm, self.timeout, self._callable.signature.name):
            try:
                return self._callable(*args, **kwargs)
            except (ValueError, MoagenError) as error:
                if not self._agreed:  # the others wait in the agreement: tell them why
                    self._exchange(None, None, f"{type(error).__name__}: {error}")
                raise

    def bytes_sent(self, sizes) -> int:
        return self.mapping.bytes_sent(sizes, self.comm.Get_size(), DTYPE_BYTES[self.dtype])

    def _agree(self, sizes, scalars):
        """KernelCallable's validate hook: this rank's own checks, then everyone's."""
        error = None
        try:
            self._check_here(sizes, scalars)
        except ValueError as e:
            error = str(e)
        everyone = self._exchange(sizes, scalars, error)
        failed = [(r, e) for r, (_, _, e) in enumerate(everyone) if e]
        name = self._callable.signature.name
        if failed:
            raise RankMismatch(f"{name}: " + "; ".join(f"rank {r}: {e}" for r, e in failed))
        shared = [({k: v for k, v in s.items() if k not in self.mapping.per_rank}, c)
                  for s, c, _ in everyone]
        if any(x != shared[0] for x in shared):
            listing = "; ".join(f"rank {r}: " + " ".join(f"{k}={v}" for k, v in {**s, **c}.items())
                                for r, (s, c) in enumerate(shared))
            raise RankMismatch(f"{name}: the ranks were given different sizes or scalars, which "
                               f"must agree: {listing}")
        if self.mapping.empty_when_zero and not any(
                s[self.mapping.empty_when_zero] for s, _, _ in everyone):
            raise RankMismatch(f"{name}: no rank holds a valid row ({self.mapping.empty_when_zero}"
                               " = 0 everywhere): a softmax over no rows")

    def _check_here(self, sizes, scalars):
        rows = self.mapping.empty_when_zero
        if self._local_validate is not None and not (rows and sizes[rows] == 0):
            self._local_validate(dict(sizes), dict(scalars))
        for name, count in self.mapping.message_elements(sizes).items():
            if count > INT_MAX:
                raise ValueError(f"{name} is {count} elements a message, more than an MPI count "
                                 f"({INT_MAX}) can say; use more ranks")

    def _exchange(self, sizes, scalars, error):
        self._agreed = True
        return self.comm.allgather((sizes, scalars, error))

"""Process settings a run's numbers depend on, read from the config (so config.yaml records them).

``NUM_THREADS``: torch's intra-op thread count. A CPU reduction (convolution, matmul, sum) splits
its work by the number of threads, and the partial sums are added in another order when that
number changes: the weights then differ from the first iteration on (measured: 2e-5 after one
step, AP differences of several points after a short CPU run). torch's default is the machine's
core count, so the same seed gives other numbers on another machine. A fixed value gives
identical results on every machine with the same CPU instruction set (AVX-512 vs AVX2 kernels
still round differently). 0 keeps torch's default.

``end_distributed``: a launched worker that returns with its process group alive can abort at
exit (gloo's threads: SIGABRT, "terminate called without an active exception"), which fails the
whole launch after the work is done; every worker ends with it.

``cpu_seconds``: user + system CPU time of the given ``resource.RUSAGE_*`` sets, how the
pipeline and the training hooks measure a stage's cost.
"""
import logging
import resource

import torch
import torch.distributed as dist

__all__ = ["apply_num_threads", "cpu_seconds", "end_distributed"]

logger = logging.getLogger(__name__)


def apply_num_threads(cfg):
    """torch.set_num_threads(cfg.NUM_THREADS) when it is > 0; returns the thread count in use."""
    n = int(cfg.NUM_THREADS)
    if n < 0:
        raise ValueError(f"NUM_THREADS must be >= 0 (0 = torch's default), got {n}")
    if n > 0 and torch.get_num_threads() != n:
        torch.set_num_threads(n)
        logger.info("torch intra-op threads: %d (NUM_THREADS)", n)
    return torch.get_num_threads()


def end_distributed():
    """After a launched worker's work: wait for every rank, then destroy the process group."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def cpu_seconds(*who):
    """User + system CPU seconds of ``who`` (``resource.RUSAGE_SELF``: this process's threads;
    ``resource.RUSAGE_CHILDREN``: its children that have ended, and theirs)."""
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, who))

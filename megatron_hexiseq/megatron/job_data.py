"""A job's data: each step's global batch split by the job, every domain reading its own share.

Megatron-LM's ``single`` data loader (``MegatronPretrainingSampler``) walks the dataset in order
from ``consumed_samples``, one global batch per step, and hands every data-parallel rank its
contiguous slice. A job has one global batch per step too, split unevenly: domain ``d`` takes the
``job.sample_range(d)`` slice of every step (``JobPlan``: domains in file order, each a contiguous
run of ``micro_batches x micro_batch_size`` sequences). :class:`JobBatchSampler` yields exactly
that, one micro-batch of sample indices at a time:

    step t (counted from ``consumed_samples``), domain d, micro-batch i:
    indices [c + t*B + start_d + i*b, c + t*B + start_d + (i+1)*b)

(c = consumed_samples, B = global batch, b = micro-batch size). So

- the domains of one step read the global batch's indices once each (none twice, none skipped);
- every rank of a domain reads the same sequences (the indices depend on the job and the step
  only, never on the rank inside the domain);
- a resumed run (Megatron restores ``consumed_train_samples`` = steps done x B) continues where
  the interrupted one stopped, under this job or another with the same global batch, as Megatron's
  own sampler continues a plain run;
- the run stops before a step the dataset cannot fill for every domain (Megatron's ``drop_last``),
  so no domain runs a step the others do not.

:class:`JobDataLoaders` replaces Megatron-LM's ``build_pretraining_data_loader`` (the name
``megatron.training.training`` calls; the plugin installs it for ``--hexiseq-job``): the training,
validation and test loaders of a job run all split the same way (Megatron's evaluation runs the
job's micro-batch count per rank too).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.job import SampleRange


class JobBatchSampler:
    """Batch sampler of one domain of a job: its micro-batches of every step, in order.

    Same interface as Megatron-LM's ``MegatronPretrainingSampler`` (``len`` = the dataset's
    samples; iterating yields lists of ``micro_batch_size`` sample indices)."""

    def __init__(
        self,
        *,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        global_batch: int,
        samples: SampleRange,
    ) -> None:
        start, stop = samples
        if total_samples <= 0:
            raise HexiSeqError(f"no sample to train on: the dataset has {total_samples}")
        if not 0 <= consumed_samples < total_samples:
            raise HexiSeqError(
                f"consumed samples {consumed_samples} are outside the dataset's {total_samples}; "
                "the run has no data left (raise --train-samples / --train-iters' data)"
            )
        if micro_batch_size < 1 or global_batch % micro_batch_size:
            raise HexiSeqError(
                f"a global batch of {global_batch} is not a whole number of micro-batches of "
                f"{micro_batch_size}"
            )
        if not 0 <= start < stop <= global_batch or (stop - start) % micro_batch_size:
            raise HexiSeqError(
                f"sample range [{start}, {stop}) is not a whole number of micro-batches of "
                f"{micro_batch_size} inside a global batch of {global_batch}"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.global_batch = global_batch
        self.samples = SampleRange(start, stop)

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[list[int]]:
        start, stop = self.samples
        b = self.micro_batch_size
        base = self.consumed_samples
        while base + self.global_batch <= self.total_samples:
            for first in range(base + start, base + stop, b):
                yield list(range(first, first + b))
            base += self.global_batch


class JobDataLoaders:
    """Megatron-LM's ``build_pretraining_data_loader(dataset, consumed_samples)`` for one domain.

    A ``torch.utils.data.DataLoader`` over a :class:`JobBatchSampler` with Megatron's loader
    settings (``--num-workers``, persistent workers, its exit-signal handler in the workers,
    pinned memory on CUDA unless ``pin_memory`` says otherwise). ``get_args`` returns Megatron's
    args at call time."""

    def __init__(
        self,
        *,
        samples: SampleRange,
        global_batch: int,
        micro_batch_size: int,
        get_args: Callable[[], argparse.Namespace],
        pin_memory: bool | None = None,
    ) -> None:
        self.samples = samples
        self.global_batch = global_batch
        self.micro_batch_size = micro_batch_size
        self._get_args = get_args
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory

    def sampler(self, total_samples: int, consumed_samples: int) -> JobBatchSampler:
        return JobBatchSampler(
            total_samples=total_samples,
            consumed_samples=consumed_samples,
            micro_batch_size=self.micro_batch_size,
            global_batch=self.global_batch,
            samples=self.samples,
        )

    def __call__(self, dataset: Any, consumed_samples: int) -> Any:
        if dataset is None:
            return None
        args = self._get_args()
        workers = int(getattr(args, "num_workers", 0) or 0)
        worker_init = None
        if getattr(args, "exit_signal_handler", False) and workers > 0:
            worker_init = _SignalHandlerInWorkers(args.exit_signal)
        return torch.utils.data.DataLoader(
            dataset,
            batch_sampler=self.sampler(len(dataset), consumed_samples),
            num_workers=workers,
            pin_memory=self.pin_memory,
            persistent_workers=workers > 0,
            worker_init_fn=worker_init,
        )


class _SignalHandlerInWorkers:
    """Megatron-LM's worker_init_fn: each loader worker enters its exit-signal handler."""

    def __init__(self, signal: Any) -> None:
        self.signal = signal

    def __call__(self, _worker: int) -> None:
        from megatron.training.dist_signal_handler import DistributedSignalHandler

        DistributedSignalHandler(self.signal).__enter__()

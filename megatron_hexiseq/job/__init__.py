"""Whole-job planning on a mixed cluster: domains of GPUs, each with its own HexiSeq layout and its
own share of the global batch (``spec``: the ``JobPlan`` contract and its file).

This layer sits above ``planner`` and ``costmodel``: the single-sequence planner is called per
domain; ``varlen`` and the Megatron integration read job files from here. The planner is
``job.search.plan_job`` (not imported here: reading a job file needs no solver); ``job.evaluate``
prices domains and jobs, ``job.shares`` the exact min-max shares (docs/job.md).
"""

from megatron_hexiseq.job.spec import Domain, DomainRank, JobPlan, SampleRange

__all__ = ["Domain", "DomainRank", "JobPlan", "SampleRange"]

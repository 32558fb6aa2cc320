"""Measuring real devices -> cluster spec: micro-benchmarks (``measure``) and the profile run
that assembles them (``run``). Library code: the CPU testbed's step calibration comes in as a
:class:`~megatron_hexiseq.profile.run.CpuCalibration` argument."""

"""Benchmarks behind `sparkinfer bench <name>`.

Every benchmark is a module `sparkinfer.bench.<name>` with exactly two public
functions, which the command line calls:

    add_arguments(parser)   register its options on an argparse parser
    main(args) -> int       run; 0 when every correctness check passed

`main` writes JSON rows through `common.append_rows(path, rows, common.metadata(args))`
(GPU, driver, versions, commit, date, command without machine paths), shows a
progress bar and summary tables through `report`, and a PNG through
`report.save_plot`. `--dry-run` runs a tiny size on the CPU (CPU ranks with the
Triton interpreter where the benchmark needs ranks).

Modules: comm, fused, moe, attention, decode, broadcast, serve (benchmarks); summarize (the docs tables from
benchmarks/results/); suite (the one-GPU benchmarks and GPU tests in one call, inside a time budget); common,
timing, collectives, report (shared helpers); launches (a counter of the kernels a piece of work launches, for
tests and profiling); timeline (each kernel's share of an overlapped step, for --profile). Nothing is imported
at package import.
"""

__all__: list[str] = []

"""What the tools above the recipe use (they import train_ddp.py and the core; the copy of the recipe takes none of
it): the benchmark's instruments (benchmark.py), the CPU checks (cpu_checks.py), the original script's input pipeline
(original_script.py), the baseline bench.py compares against; the tools' one-line exit on SIGTERM and Ctrl-C
(tool_exit.py: bench.py, preflight.py, plot.py); and BatchNorm statistics recomputed over all ranks (bn_stats.py: for
SWA's average at ADAPT (6/6); the recipe does not use it)."""

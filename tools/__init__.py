"""What bench.py measures with, above the recipe (they import train_ddp.py and the core): the benchmark's
instruments (benchmark.py), the CPU checks (cpu_checks.py) and the original script's input pipeline
(original_script.py), the baseline bench.py compares against."""

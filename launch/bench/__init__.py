"""Benchmarks, run as `python -m launch.bench NAME [flags]` (`__main__`): one module per benchmark
(`sampler`, `train`, `e2e`, `episodes`, `serve`, `device`, and `split_mesh` for `async`), the flags
and measurements they share (`shared`) and the machine's readings around a step (`probes`)."""

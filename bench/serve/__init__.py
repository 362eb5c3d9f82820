"""`tandem bench serve` and the load generator the serving benchmarks compose: config, run,
datasets, metrics, guided load, backends, and the workload arms rerun (`workload.py`)."""

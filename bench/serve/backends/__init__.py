"""The engines `tandem bench serve` drives: `base.py` is the interface, `registry.py` picks one."""

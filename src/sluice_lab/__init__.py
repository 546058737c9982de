"""sluice's lab: experiments, the load generator, engine and peer benchmarks, and their scenarios.

The lab imports the product (`sluice`) and never the reverse. `sluice bench ...` reaches it through
`sluice_lab.cli`; its extra dependencies (matplotlib for plots, and torch through the engine) come
with `pip install 'sluice[lab]'`.
"""

"""Experiments behind `sluice bench policies|chunk-sweep|isolation|gateway-overhead`.

Each writes a JSON summary and a PNG plot; numbers are relative (ratios from one run), so the
same commands run on a 2-core CPU with the demo model and on a GPU with a real model.
"""

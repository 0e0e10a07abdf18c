"""The end-to-end pipeline behind the command line.

- ``config``   strict TOML schema of ``shiftguard run --config`` (and the built-in default)
- ``run``      ``shiftguard run``: train, shift, evaluate, report
- ``evaluate`` the evaluation protocol (heads fitted on clean train embeddings, metrics per cell)
- ``report``   ``shiftguard report``: results.csv, plots, self-contained report.html, comparisons
- ``plots``    the figures
"""

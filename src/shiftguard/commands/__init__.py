"""The end-to-end pipeline behind the command line.

- ``config``   strict TOML schema of ``shiftguard run --config`` (and the built-in default)
- ``run``      ``shiftguard run``: train, shift (corruptions, attacks), evaluate, report
- ``evaluate`` ``shiftguard evaluate``: a user's model and weights through ``shiftguard.evaluate``
- ``report``   ``shiftguard report``: results.csv, plots, self-contained report.html, comparisons
- ``transfer`` ``shiftguard transfer``: the URL transfer benchmark of the uncertainty estimators
- ``toy``, ``corrupt``, ``gallery``, ``rundir``: the toy, corrupted-set export, galleries, run folders
"""

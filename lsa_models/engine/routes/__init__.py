"""The certification routes (table.py lists them) and the public functions that read them:
certify_local and robustness (certify.py), decide at a radius (at_radius.py), the radius
sweep and search, time budgets (docs/local-robustness.md).
"""

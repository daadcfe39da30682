"""The golden corpus: every certified number the tests and benches produce (global bounds,
local constants, certified radii, set verdicts), recorded per route before and after a change
of the engine and compared (corpus.py, record.py, compare.py, routes.py)."""

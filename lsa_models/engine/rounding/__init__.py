"""The centre's forward pass proven: float64 forward error by a checked a-posteriori bound and
by ball arithmetic (docs/local-rounding.md).
"""

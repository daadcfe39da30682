"""Certify: what reaches into every domain that issues certificates, above them all:
`POST /certify` (routes: each kind issued by its domain), the CI gate `lsa certify`
(cli_certify) and `lsa verify` (cli_verify: the signature, and with --recompute the bound,
radius or set verdicts recomputed by the domains' own code)."""

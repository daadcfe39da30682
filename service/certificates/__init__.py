"""Certificates: the one module that states, signs, stores and judges every kind (service),
`POST /certify` and the certificate reads and verification (routes), and the CLI's
`lsa certify` (cli_certify) and `lsa verify` (cli_verify)."""

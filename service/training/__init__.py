"""Training: `POST /corpora` and `GET /artifacts` (routes), the wire-to-library mapping,
the checks and storing an outcome (service), and the `train_certified` job (jobs)."""

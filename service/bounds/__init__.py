"""Bounds: `POST /bound` (routes), the stored reports and the Lipschitz certificate of one
(service), the ball around one input (local), the reports of a model file (files), the
`bound` job (jobs) and `lsa bound` (cli)."""

"""Bounds: `POST /bound` (routes), the stored reports and the Lipschitz certificate of one
(service), the ball around one input (local), the `bound` job (jobs) and `lsa bound` (cli)."""

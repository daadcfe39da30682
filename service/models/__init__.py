"""Models: `POST /models` and the model reads (routes), storing an upload once and reading
the rows (service)."""

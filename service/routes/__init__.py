"""HTTP routes shared by the domains: health and metrics, upload staging, and the notice of a
request body without `kind`. Each domain's routes live in its package
(`service.<domain>.routes`)."""

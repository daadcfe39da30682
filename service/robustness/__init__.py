"""Robustness: the radii and set certificates of `POST /certify` (service), the radii and
verdicts of a loaded model (verdicts), the `robustness` jobs (jobs), the process pool that
decides a set (set_pool), a set certificate's counterexamples (routes), and `lsa robustness`
(cli, cli_set). Empty on import: the set
pool's forkserver preloads `service.robustness.set_pool`."""

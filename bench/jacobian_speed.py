"""Matrix-free Jacobian 2-norm (Lanczos on J^T J via jvp/vjp) against jacrev + SVD.

One L2-MHA layer at a random input, float32, one thread. For N*D in --baseline sizes both
methods run in the same process (time ratio, relative difference); for --free-only sizes the
matrix-free method runs alone (J would not fit: at N*D = 262144 it has 6.9e10 entries).
Targets: >= 100x faster at 16384 with relative difference <= 1e-4; 262144 within
60 s. Writes bench/out/jacobian_speed.json and .png and prints the JSON.

    .venv/bin/python bench/jacobian_speed.py [--baseline 1024 4096 16384]
                                             [--free-only 65536 262144]
"""

from __future__ import annotations

import os

# One thread for BLAS too (numpy/scipy in the reference, and spawned children inherit it).
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from lsa_models import L2MHA  # noqa: E402
from lsa_models.empirical import jacobian_norm  # noqa: E402
from lsa_models.empirical.jacobian import differentiable_attention  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"


def build(d_model: int, heads: int, n: int, seed: int, dtype: torch.dtype):
    torch.manual_seed(seed)
    model = L2MHA(d_model, heads).to(dtype).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n, d_model, generator=g, dtype=torch.float64).to(dtype)  # (N, D)

    def f(z: torch.Tensor) -> torch.Tensor:  # (N, D) -> (N, D)
        return model(z.unsqueeze(0)).squeeze(0)

    return f, x


# Wall time is what a user waits for; CPU time of this process is reported next to it because
# the shared 2-core machine may run other jobs (wall >> cpu then means contention).


def matrix_free(f, x: torch.Tensor, tol: float) -> dict:
    t0, c0 = time.perf_counter(), time.process_time()
    r = jacobian_norm(f, x, "2", tol=tol, max_iter=300)
    return {"value": r.value, "seconds": time.perf_counter() - t0,
            "cpu_seconds": time.process_time() - c0, "products": r.iterations,
            "converged": r.converged, "rel_residual": r.rel_residual}


def baseline(f, x: torch.Tensor, chunk: int, report=None) -> dict:
    """jacrev + SVD. `report(partial)` receives the jacrev timing and an independent
    reference norm (ARPACK on the materialised J) before the SVD starts, so a run whose SVD
    is cut off by the time limit still has its accuracy check."""
    from scipy.sparse.linalg import svds

    t0, c0 = time.perf_counter(), time.process_time()
    with differentiable_attention():
        j = torch.func.jacrev(f, chunk_size=chunk)(x).reshape(-1, x.numel())  # (ND, ND)
    t1 = time.perf_counter()
    out = {"jacrev_seconds": t1 - t0, "jacobian_bytes": j.numel() * j.element_size()}
    dense = j.numpy()
    ref = float(svds(dense, k=1, tol=1e-9, return_singular_vectors=False,
                     random_state=0)[0])
    out["arpack_reference"] = ref
    if report is not None:
        report(dict(out))
    t2, c2 = time.perf_counter(), time.process_time()
    value = float(torch.linalg.svdvals(j)[0])
    t3 = time.perf_counter()
    out.update({"value": value, "svd_seconds": t3 - t2,
                "seconds": out["jacrev_seconds"] + (t3 - t2),
                "cpu_seconds": (c2 - c0) + (time.process_time() - c2)})
    return out


def _baseline_child(queue, d_model: int, heads: int, n: int, seed: int, chunk: int,
                    threads: int) -> None:
    torch.set_num_threads(threads)
    warm_up(d_model, heads, torch.float32, with_baseline=False)
    f, x = build(d_model, heads, n, seed, torch.float32)
    queue.put(("started", {"cpu_before_baseline": time.process_time()}))
    queue.put(("final", baseline(f, x, chunk, lambda part: queue.put(("partial", part)))))


def baseline_with_limit(args, n: int, limit_s: float) -> dict:
    """The baseline in a child process (spawned, same seeds) that is stopped after limit_s:
    at N*D = 16384 an SVD of the 1 GB Jacobian takes tens of minutes on one thread."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_baseline_child, args=(queue, args.d_model, args.heads, n,
                                                     args.seed, args.chunk, args.threads))
    start = time.perf_counter()
    proc.start()
    partial: dict = {}
    cpu_before: float | None = None  # the child's start-up and warm-up: not baseline work
    try:
        while True:
            left = limit_s - (time.perf_counter() - start)
            if left <= 0:
                break
            try:
                kind, payload = queue.get(timeout=min(left, 5.0))
            except Exception:  # queue.Empty: keep waiting while the child lives
                if not proc.is_alive():
                    break
                continue
            if kind == "final":
                return payload
            if kind == "started":
                cpu_before = payload["cpu_before_baseline"]
                continue
            partial = payload
    finally:
        cpu = _cpu_seconds_of(proc.pid)
        if proc.is_alive():
            proc.terminate()
        proc.join()
    partial["timed_out_after_s"] = time.perf_counter() - start
    partial["seconds_at_least"] = partial["timed_out_after_s"]
    if cpu is not None and cpu_before is not None:
        partial["cpu_seconds_at_least"] = cpu - cpu_before
    return partial


def _cpu_seconds_of(pid: int | None) -> float | None:
    """CPU time (user + system) a live child has used so far, from /proc (Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def warm_up(d_model: int, heads: int, dtype: torch.dtype, with_baseline: bool = True) -> None:
    """The first jvp/vjp/jacrev of a process pays seconds of one-off setup: not timed."""
    f, x = build(d_model, heads, 2, 0, dtype)
    matrix_free(f, x, 1e-3)
    if with_baseline:
        baseline(f, x, 64)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    free = [(r["nd"], r["matrix_free"]["seconds"]) for r in rows]
    base = [(r["nd"], r["baseline"]["seconds"]) for r in rows
            if "seconds" in r.get("baseline", {})]
    cut = [(r["nd"], r["baseline"]["seconds_at_least"]) for r in rows
           if "seconds_at_least" in r.get("baseline", {})]
    ax.plot(*zip(*free, strict=True), "o-", label="matrix-free Lanczos (jvp/vjp)")
    if base:
        ax.plot(*zip(*base, strict=True), "s--", label="jacrev + SVD")
    if cut:
        ax.plot(*zip(*cut, strict=True), "^", color="C1", label="jacrev + SVD (stopped: >=)")
    ax.axhline(60, color="grey", lw=0.8, ls=":", label="60 s target")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("N * D (input size)")
    ax.set_ylabel(f"seconds (wall), {torch.get_num_threads()} thread(s)")
    ax.set_title("Jacobian spectral norm of one L2-MHA layer")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=int, nargs="*", default=[1024, 4096, 16384],
                    help="N*D sizes run with both methods")
    ap.add_argument("--free-only", type=int, nargs="*", default=[65536, 262144],
                    help="N*D sizes run matrix-free only")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--tol", type=float, default=1e-6)
    ap.add_argument("--chunk", type=int, default=1024, help="jacrev rows per vmapped batch")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--baseline-limit", type=float, default=600.0,
                    help="stop jacrev + SVD after this many seconds (wall) per size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT / "jacobian_speed.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_start = list(os.getloadavg())
    dtype = torch.float32
    warm_up(args.d_model, args.heads, dtype)
    rows = []
    sizes = [(s, True) for s in args.baseline] + [(s, False) for s in args.free_only]
    for nd, with_baseline in sizes:
        if nd % args.d_model:
            raise SystemExit(f"N*D={nd} is not a multiple of D={args.d_model}")
        n = nd // args.d_model
        f, x = build(args.d_model, args.heads, n, args.seed, dtype)
        row: dict = {"nd": nd, "n": n, "d_model": args.d_model,
                     "matrix_free": matrix_free(f, x, args.tol)}
        if with_baseline:
            b = baseline_with_limit(args, n, args.baseline_limit)
            row["baseline"] = b
            free = row["matrix_free"]["value"]
            free_cpu = row["matrix_free"]["cpu_seconds"]
            if "value" in b:
                row["speedup"] = b["seconds"] / row["matrix_free"]["seconds"]
                row["speedup_cpu"] = b["cpu_seconds"] / free_cpu
                row["rel_diff"] = abs(free - b["value"]) / b["value"]
            else:  # SVD stopped at the limit: the speed-up is at least this
                row["speedup_at_least"] = b["seconds_at_least"] / row["matrix_free"]["seconds"]
                if "cpu_seconds_at_least" in b:
                    row["speedup_cpu_at_least"] = b["cpu_seconds_at_least"] / free_cpu
            if "arpack_reference" in b:
                ref = b["arpack_reference"]
                row["rel_diff_arpack"] = abs(free - ref) / ref
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    result = {
        "benchmark": "jacobian_speed",
        "model": f"L2MHA(D={args.d_model}, H={args.heads}), random init seed {args.seed}",
        "dtype": "float32",
        "tol": args.tol,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "load_average_at_start": load_start,
        "load_average_at_end": list(os.getloadavg()),
        "rows": rows,
        "baseline_limit_s": args.baseline_limit,
        "targets": {"speedup_at_16384": ">= 100", "rel_diff_at_16384": "<= 1e-4",
                    "seconds_at_262144": "<= 60"},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    png = args.out.with_suffix(".png")
    plot(rows, png)
    result["plot"] = str(png)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()

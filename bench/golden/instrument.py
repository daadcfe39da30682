"""Which route gave which number: the route functions of the engine, wrapped for the length
of one call of `certify_local`, `robustness` or `decide_all`, each call's value and seconds
recorded (the library is not edited: module attributes are swapped and restored).

A route is recorded only where it is called from the public function itself, not from inside
another route (the sweep's enclosures are the sweep's). Targets that a revision of the engine
does not have are skipped, so a record of any revision keeps its numbers; its route table
then names only the routes it still finds here.
"""

from __future__ import annotations

import importlib
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

LOCAL = "lsa_models.engine.local"
AT_RADIUS = "lsa_models.engine.at_radius"


def _finite(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _affine_name(kw: dict[str, Any]) -> str:
    if kw.get("eig"):
        return "affine-eig"
    return "affine-quad" if kw.get("quad") else "affine"


def _adjoint_norms() -> tuple[str, ...]:
    try:
        return tuple(importlib.import_module(LOCAL).ADJOINT_NORMS)
    except (ImportError, AttributeError):
        return ("inf",)


def _sweep_name(args: tuple[Any, ...], kw: dict[str, Any]) -> str:
    norm = args[2] if len(args) > 2 else kw.get("norm")
    adjoint = kw.get("adjoint", True)
    return "sweep-adjoint" if adjoint and norm in _adjoint_norms() else "sweep"


def _lows(low: Any) -> float | None:
    return None if not low else _finite(min(low.values()))


def _upper(lj: Any) -> float | None:
    return _finite(lj.upper())


# (module, attribute, route name from the call's (args, kwargs), value from the result)
Namer = Callable[[tuple[Any, ...], dict[str, Any]], str]
TARGETS: tuple[tuple[str, str, Namer, Callable[[Any], float | None]], ...] = (
    (LOCAL, "_global", lambda a, k: "global", lambda r: _finite(r.upper)),
    (LOCAL, "local_jacobian", lambda a, k: "enclosure", _upper),
    (LOCAL, "_ball_candidate", lambda a, k: "ball", _finite),
    (LOCAL, "_adjoint_candidate", lambda a, k: "adjoint", _finite),
    (LOCAL, "_tangent_candidate", lambda a, k: "tangent", _finite),
    (LOCAL, "affine_radius", lambda a, k: _affine_name(k), lambda r: _finite(r[0])),
    (LOCAL, "_sweep", _sweep_name, lambda r: _finite(r[0])),
    (LOCAL, "attack_radius", lambda a, k: "attack", _finite),
    (AT_RADIUS, "margin_lower_bounds", lambda a, k: _affine_name(k), _lows),
    (AT_RADIUS, "_sweep", _sweep_name, lambda r: _finite(r[0])),
    (AT_RADIUS, "attack_at", lambda a, k: "attack", lambda r: None if r is None else 1.0),
)
# the local constant's optional routes, run directly where certify_local's own test skipped
# them, to see whether they would have won (recorded as forced, outside its seconds)
FORCEABLE = ("adjoint", "tangent")


@dataclass
class Call:
    route: str
    value: float | None
    seconds: float
    cpu_seconds: float
    error: str | None = None
    forced: bool = False

    def row(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None and v is not False}


@dataclass
class Recorder:
    calls: list[Call] = field(default_factory=list)
    depth: int = 0
    originals: dict[tuple[str, str], Any] = field(default_factory=dict)

    def wrap(self, fn: Callable[..., Any], name: Namer, value: Callable[[Any], float | None]
             ) -> Callable[..., Any]:
        def wrapper(*args: Any, **kw: Any) -> Any:
            if self.depth > 0:
                return fn(*args, **kw)
            self.depth += 1
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                out = fn(*args, **kw)
            except Exception as exc:
                self.calls.append(Call(name(args, kw), None, time.perf_counter() - t0,
                                       time.process_time() - c0,
                                       error=f"{type(exc).__name__}: {exc}"[:200]))
                raise
            finally:
                self.depth -= 1
            self.calls.append(Call(name(args, kw), value(out), time.perf_counter() - t0,
                                   time.process_time() - c0))
            return out
        return wrapper

    @contextmanager
    def patched(self) -> Iterator[Recorder]:
        for mod_name, attr, name, value in TARGETS:
            try:
                mod = importlib.import_module(mod_name)
            except ImportError:
                continue
            fn = getattr(mod, attr, None)
            if fn is None:
                continue
            self.originals[(mod_name, attr)] = fn
            setattr(mod, attr, self.wrap(fn, name, value))
        try:
            yield self
        finally:
            for (mod_name, attr), fn in self.originals.items():
                setattr(importlib.import_module(mod_name), attr, fn)
            self.originals.clear()

    def force(self, route: str, *args: Any) -> None:
        """Runs the local constant's optional `route` directly (its function as the engine
        has it), recorded as forced."""
        attr = {"adjoint": "_adjoint_candidate", "tangent": "_tangent_candidate"}[route]
        try:
            fn = getattr(importlib.import_module(LOCAL), attr)
        except (ImportError, AttributeError):
            return
        t0, c0 = time.perf_counter(), time.process_time()
        err = None
        try:
            v = _finite(fn(*args))
        except Exception as exc:  # a route that fails records why, like the others
            v, err = None, f"{type(exc).__name__}: {exc}"[:200]
        self.calls.append(Call(route, v, time.perf_counter() - t0, time.process_time() - c0,
                               error=err, forced=True))


def record_calls(fn: Callable[..., Any], *args: Any, **kw: Any) -> tuple[Any, list[Call]]:
    """fn(*args, **kw) with its route calls recorded."""
    rec = Recorder()
    with rec.patched():
        out = fn(*args, **kw)
    return out, rec.calls

"""Which route gave which number: the route functions of the engine, wrapped for the length
of one call of `certify_local`, `robustness` or `decide_all`, each call's value and seconds
recorded (the library is not edited: the route tables of lsa_models/engine/routes/table.py and
module attributes are swapped and restored).

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
from dataclasses import dataclass, field, replace
from typing import Any

LOCAL = "lsa_models.engine.routes.certify"
AT_RADIUS = "lsa_models.engine.routes.at_radius"
ROUTES = "lsa_models.engine.routes.table"
RADIUS_SEARCH = "lsa_models.engine.routes.radius_search"


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
    for mod in ("lsa_models.engine.routes.sweep", LOCAL):
        try:
            return tuple(importlib.import_module(mod).ADJOINT_NORMS)
        except (ImportError, AttributeError):
            continue
    return ("inf",)


def _sweep_name(args: tuple[Any, ...], kw: dict[str, Any]) -> str:
    norm = args[2] if len(args) > 2 else kw.get("norm")
    adjoint = kw.get("adjoint", True)
    return "sweep-adjoint" if adjoint and norm in _adjoint_norms() else "sweep"


def _lows(low: Any) -> float | None:
    return None if not low else _finite(min(low.values()))


def _upper(lj: Any) -> float | None:
    return _finite(lj.upper())


def _global_upper(r: Any) -> float | None:
    return _finite(r.upper)


def _sweep_radius(r: Any) -> float | None:
    return _finite(r[0])


def _named(route: str) -> Callable[[tuple[Any, ...], dict[str, Any]], str]:
    return lambda a, k: route


# the route tables of routes.py: (module, table, value from the result by route name; None:
# the sweep's, named by the call). Each entry's callable is wrapped under its route's name.
TABLES: tuple[tuple[str, str, dict[str, Callable[[Any], float | None]] | None], ...] = (
    (ROUTES, "LOCAL_ROUTES", {"global": _global_upper, "enclosure": _upper,
                              "adjoint": _finite, "tangent": _finite}),
    (ROUTES, "AFFINE_STAGES", {"affine": _lows, "affine-quad": _lows, "affine-eig": _lows}),
    (ROUTES, "SWEEP_PASSES", None),
)

# (module, attribute, route name from the call's (args, kwargs), value from the result): the
# radius search's affine walks, the attacks, and earlier revisions' route functions (before
# routes.py; skipped where absent, so their records keep their numbers)
Namer = Callable[[tuple[Any, ...], dict[str, Any]], str]
TARGETS: tuple[tuple[str, str, Namer, Callable[[Any], float | None]], ...] = (
    (RADIUS_SEARCH, "affine_radius", lambda a, k: _affine_name(k), lambda r: _finite(r[0])),
    (LOCAL, "_global", lambda a, k: "global", _global_upper),
    (LOCAL, "local_jacobian", lambda a, k: "enclosure", _upper),
    (LOCAL, "_ball_candidate", lambda a, k: "ball", _finite),
    (LOCAL, "_adjoint_candidate", lambda a, k: "adjoint", _finite),
    (LOCAL, "_tangent_candidate", lambda a, k: "tangent", _finite),
    (LOCAL, "affine_radius", lambda a, k: _affine_name(k), lambda r: _finite(r[0])),
    (LOCAL, "_sweep", _sweep_name, _sweep_radius),
    (LOCAL, "attack_radius", lambda a, k: "attack", _finite),
    (AT_RADIUS, "margin_lower_bounds", lambda a, k: _affine_name(k), _lows),
    (AT_RADIUS, "_sweep", _sweep_name, _sweep_radius),
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

    def _wrap_table(self, mod: Any, attr: str,
                    values: dict[str, Callable[[Any], float | None]] | None) -> None:
        """The table's routes with their callables wrapped, the table kept to restore."""
        table = getattr(mod, attr, None)
        if table is None:
            return
        self.originals[(mod.__name__, attr)] = table
        wrapped = []
        for r in table:
            namer: Namer
            value: Callable[[Any], float | None]
            if values is None:
                namer, value = _sweep_name, _sweep_radius
            else:
                namer, value = _named(r.name), values[r.name]
            wrapped.append(replace(r, run=self.wrap(r.run, namer, value)))
        setattr(mod, attr, tuple(wrapped))

    @contextmanager
    def patched(self) -> Iterator[Recorder]:
        for mod_name, attr, values in TABLES:
            try:
                mod = importlib.import_module(mod_name)
            except ImportError:
                continue
            self._wrap_table(mod, attr, values)
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
        fn = _local_route(route)
        if fn is None:
            return
        t0, c0 = time.perf_counter(), time.process_time()
        err = None
        try:
            v = _finite(fn(*args))
        except Exception as exc:  # a route that fails records why, like the others
            v, err = None, f"{type(exc).__name__}: {exc}"[:200]
        self.calls.append(Call(route, v, time.perf_counter() - t0, time.process_time() - c0,
                               error=err, forced=True))


def _local_route(route: str) -> Callable[..., Any] | None:
    """The local constant's route `route` as the engine has it: routes.py's table, or the
    function of local.py before it."""
    try:
        for r in importlib.import_module(ROUTES).LOCAL_ROUTES:
            if r.name == route:
                return r  # type: ignore[no-any-return]
    except (ImportError, AttributeError):
        pass
    attr = {"adjoint": "_adjoint_candidate", "tangent": "_tangent_candidate"}[route]
    try:
        return getattr(importlib.import_module(LOCAL), attr)  # type: ignore[no-any-return]
    except (ImportError, AttributeError):
        return None


def record_calls(fn: Callable[..., Any], *args: Any, **kw: Any) -> tuple[Any, list[Call]]:
    """fn(*args, **kw) with its route calls recorded."""
    rec = Recorder()
    with rec.patched():
        out = fn(*args, **kw)
    return out, rec.calls

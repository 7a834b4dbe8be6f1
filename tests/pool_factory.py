"""One place that starts the tests' process pools, and shares them.

A module asks the session's ``pool_factory`` fixture for a pool by its
options (``PoolOptions``: workers, model, keys, flags, environment), most
often through a fixture made by ``pool_fixture(**options)``. Every module
that asks with equal options gets the same running pool, one after the
other; between two users the factory checks that the pool is whole and
idle (every process alive, as many workers as asked for, free slots equal
to live workers). A pool a module changed (a worker killed and not
replaced) is stopped and started afresh for the next user; one that leaked
a slot fails the module that leaked it.

The factory knows, from the collected tests, which modules will ask for
which options (``plan_from``: the fixtures ``pool_fixture`` made carry
their options): a pool no later module needs is stopped as soon as its
last user is done, and when more than ``KEEP_RUNNING`` pools would run,
the idle one needed furthest ahead is stopped first. Pools started with
options known only at run time (a model file a fixture writes) count as
needed by nobody after their user. All are stopped, with SIGTERM and a
deadline (a process that hangs fails the run), when the session ends.

A fixture that breaks its pool on purpose (kills a worker for good,
restarts the broker, floods it) asks with ``private=True``: a pool of its
own, never handed to anyone else, stopped when the fixture ends.

``started`` counts the start-ups; the run's summary prints them
(``tests/conftest.py``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

from tests.pool import Pool

#: Pools kept running at once (in use, or idle and needed again later): the
#: default, tiny-model one-worker and no-tokenizer pools are asked for by
#: modules far apart in file order; each idle pool costs a few processes'
#: memory and heartbeats (LLAMAPOOL_TEST_KEEP_POOLS overrides).
KEEP_RUNNING = int(os.environ.get("LLAMAPOOL_TEST_KEEP_POOLS", "4"))


def _pairs(value: Mapping[str, str] | tuple) -> tuple[tuple[str, str], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((str(k), str(v)) for k, v in items))


@dataclasses.dataclass(frozen=True)
class PoolOptions:
    """How a ``Pool`` is started; equal options, one shared pool.

    The fields are ``Pool``'s keyword arguments, made hashable: the two
    environments may be given as dicts and are kept as sorted pairs.
    ``model`` None is the session's tiny model.
    """

    workers: int = 2
    model: Path | None = None
    api_keys: tuple[str, ...] = ()
    frontend_env: tuple[tuple[str, str], ...] = ()
    worker_args: tuple[str, ...] = ()
    global_args: tuple[str, ...] = ()
    frontend_tokenizes: bool = True
    broker_args: tuple[str, ...] = ()
    worker_env: tuple[tuple[str, str], ...] = ()
    wait_ready: bool = True
    slots_per_worker: int = 1

    def __post_init__(self) -> None:
        for name in ("frontend_env", "worker_env"):
            object.__setattr__(self, name, _pairs(getattr(self, name)))
        for name in ("api_keys", "worker_args", "global_args", "broker_args"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.model is not None:
            object.__setattr__(self, "model", Path(self.model))

    def start(self, default_model: Path, run_dir: Path) -> Pool:
        return Pool(self.model or default_model, run_dir, workers=self.workers,
                    api_keys=self.api_keys, frontend_env=dict(self.frontend_env),
                    worker_args=self.worker_args, global_args=self.global_args,
                    frontend_tokenizes=self.frontend_tokenizes,
                    broker_args=self.broker_args,
                    worker_env=dict(self.worker_env) or None,
                    wait_ready=self.wait_ready,
                    slots_per_worker=self.slots_per_worker)


def module_of(nodeid: str) -> str:
    """The module part of a test's node id (``tests/test_x.py``)."""
    return nodeid.split("::", 1)[0]


def current_module() -> str | None:
    """The module of the test pytest is setting up, running or tearing down."""
    current = os.environ.get("PYTEST_CURRENT_TEST")
    return module_of(current) if current else None


#: Which options each module will ask for, modules in the order they run.
Plan = list[tuple[str, frozenset[PoolOptions]]]


class PoolFactory:
    """Running pools by their options (the ``pool_factory`` fixture).

    ``with pool_factory(workers=1, api_keys=(KEY,)) as pool:`` hands out a
    pool for the block; ``private=True`` one that nobody else gets.
    ``plan`` says which modules will ask for which options; without it a
    pool is kept until room is needed (least recently used first).
    """

    def __init__(self, default_model: Path, make_dir: Callable[[str], Path],
                 keep_running: int = KEEP_RUNNING, plan: Plan | None = None) -> None:
        self._default_model = default_model
        self._make_dir = make_dir
        self.keep_running = max(1, keep_running)
        self._plan = plan
        self._position = {module: i for i, (module, _) in enumerate(plan or [])}
        #: Shared pools nobody uses now, least recently used first.
        self._idle: collections.OrderedDict[PoolOptions, Pool] = (
            collections.OrderedDict())
        #: Shared pools in use: the pool and how many fixtures hold it.
        self._in_use: dict[PoolOptions, list] = {}
        #: Start-ups by options (shared and private alike).
        self.started: collections.Counter[PoolOptions] = collections.Counter()
        self.private_started = 0
        #: Hand-outs of a shared pool that was already running.
        self.reused = 0
        #: Shared pools found changed (a worker gone) and started afresh.
        self.replaced = 0

    @contextlib.contextmanager
    def __call__(self, options: PoolOptions | None = None, /, *,
                 private: bool = False, **fields) -> Iterator[Pool]:
        if options is None:
            options = PoolOptions(**fields)
        elif fields:
            raise TypeError("give PoolOptions or its fields, not both")
        if private:
            pool = self._start(options, private=True)
            try:
                yield pool
            finally:
                pool.stop()
            return
        pool = self._acquire(options)
        try:
            yield pool
        finally:
            self._release(options, pool)

    # --- sharing -----------------------------------------------------------------

    def _acquire(self, options: PoolOptions) -> Pool:
        held = self._in_use.get(options)
        if held is not None:  # two fixtures of one module, equal options
            held[1] += 1
            self.reused += 1
            return held[0]
        pool = self._idle.pop(options, None)
        if pool is not None and not self._unchanged(pool, options):
            self.replaced += 1
            pool.stop()
            pool = None
        if pool is None:
            self._make_room()
            pool = self._start(options)
        else:
            self.reused += 1
        self._in_use[options] = [pool, 1]
        return pool

    def _release(self, options: PoolOptions, pool: Pool) -> None:
        held = self._in_use[options]
        held[1] -= 1
        if held[1]:
            return
        del self._in_use[options]
        if not self._unchanged(pool, options, ledger=False):
            # Changed on purpose, not broken: the next user gets a fresh one.
            pool.stop()
            self.replaced += 1
            return
        try:
            pool.assert_whole()  # a leaked slot fails the module that leaked it
        except AssertionError:
            pool.stop()
            raise
        if self._next_use(options) is None:
            pool.stop()  # no later module asks for these options
            return
        self._idle[options] = pool

    def _next_use(self, options: PoolOptions) -> float | None:
        """Where the next module that asks for ``options`` runs: its place
        in the plan; None if none will; infinity if it is not known (no plan)."""
        if self._plan is None:
            return float("inf")
        now = self._position.get(current_module() or "", -1)
        for i in range(now + 1, len(self._plan)):
            if options in self._plan[i][1]:
                return i
        return None

    @staticmethod
    def _unchanged(pool: Pool, options: PoolOptions, ledger: bool = True) -> bool:
        """Every process alive, as many workers as asked for, and (``ledger``)
        the broker's ledger shows them all free."""
        procs = [pool.broker, pool.frontend, *pool.workers]
        if not all(p.alive() for p in procs) or len(pool.workers) != options.workers:
            return False
        if not ledger:
            return True
        snap = pool.probe.status(timeout_s=5.0)
        return (snap is not None
                and snap["slots_total"] == snap["slots_free"]
                == options.workers * options.slots_per_worker)

    def _make_room(self) -> None:
        """Stop idle pools while one more would exceed ``keep_running``: the
        one needed furthest ahead first (with no plan, the least recently
        used)."""
        while self._idle and len(self._idle) + len(self._in_use) >= self.keep_running:
            if self._plan is None:
                _, victim = self._idle.popitem(last=False)
            else:
                def farthest(options: PoolOptions) -> float:
                    at = self._next_use(options)
                    return float("inf") if at is None else at

                victim = self._idle.pop(max(self._idle, key=farthest))
            victim.stop()

    def _start(self, options: PoolOptions, private: bool = False) -> Pool:
        self.started[options] += 1
        self.private_started += private
        run_dir = self._make_dir(f"pool{sum(self.started.values())}")
        return options.start(self._default_model, run_dir)

    # --- the session's end ------------------------------------------------------

    def close(self) -> None:
        """Stop every pool; raise if any process hung on SIGTERM."""
        pools = [*self._idle.values(), *(held[0] for held in self._in_use.values())]
        self._idle.clear()
        self._in_use.clear()
        errors = []
        for pool in pools:
            try:
                pool.stop()
            except AssertionError as exc:
                errors.append(str(exc))
        if errors:
            raise AssertionError("; ".join(errors))

    def summary(self) -> str:
        total = sum(self.started.values())
        return (f"{total} pool start-ups ({self.private_started} private) for "
                f"{len(self.started)} option sets; {self.reused} hand-outs of a "
                f"running pool; {self.replaced} replaced after a module changed it")


def pool_fixture(options: PoolOptions | None = None, /, *, private: bool = False,
                 **fields):
    """A module-scoped fixture: the factory's pool with these options.

    ``keyed_pool = pool_fixture(workers=1, api_keys=(KEY,))`` in a module.
    The fixture carries its options, so the factory can plan (``plan_from``).
    """
    options = options or PoolOptions(**fields)

    def fixture(pool_factory):
        with pool_factory(options, private=private) as pool:
            yield pool

    fixture.pool_options = None if private else options
    fixture.__doc__ = f"A {'private' if private else 'shared'} pool: {options}."
    return pytest.fixture(scope="module")(fixture)


def plan_from(items) -> Plan:
    """Which options each module's tests will ask for, in run order: from
    the fixtures they use that ``pool_fixture`` made (a module's own
    fixture of a name, not conftest's, as pytest resolves it), and those
    their module defines (a test may ask for one by name at run time,
    ``request.getfixturevalue``)."""
    plan: dict[str, set[PoolOptions]] = {}
    for item in items:
        wanted = plan.setdefault(module_of(item.nodeid), set())
        info = getattr(item, "_fixtureinfo", None)
        funcs = ([defs[-1].func for defs in info.name2fixturedefs.values()]
                 if info else [])
        module = getattr(item, "module", None)
        for value in vars(module).values() if module is not None else ():
            unwrap = getattr(value, "_get_wrapped_function", None)
            if callable(unwrap):
                funcs.append(unwrap())
        for func in funcs:
            options = getattr(func, "pool_options", None)
            if options is not None:
                wanted.add(options)
    return [(module, frozenset(opts)) for module, opts in plan.items()]

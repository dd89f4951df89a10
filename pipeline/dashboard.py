"""The RL page of the Dask dashboard, role colours in the task stream, and two routes that
do not fail (`/json/identity.json`, `/sitemap.json`).

`install()` must run in the scheduler's process before the scheduler starts, because Dask
builds the dashboard's pages and HTTP routes once, at start. The trainer's own cluster and
`dask-rl scheduler` do it through Dask's preload mechanism (`preload=["pipeline.dashboard"]`,
which imports this module, whose import installs it); any other scheduler gets the same
with `dask scheduler --preload pipeline.dashboard`. The page reads the RLMonitor plugin
(pipeline.monitor) and is listed in the dashboard's "More..." menu and in
`/individual-plots.json` (which dask-labextension reads), as every `/individual-*` page is.
"""

from __future__ import annotations

import json
import logging
import time

from distributed.http import routing
from distributed.http.utils import RequestHandler

from pipeline.monitor import NAME, PAGE, RLMonitor
from resources.config import ROLES

logger = logging.getLogger("dask_rl")
ROUTES_MODULE = __name__
# One hue per role in the task stream. Dask's own colour is an md5 of the key prefix into
# viridis, so "rollout-generate" and "actor-update" can come out as near-identical greens;
# red, orange, grey and black stay free for transfers, disk, deserialisation and errors.
ROLE_COLOURS = {"rollout": "#1f77b4", "reward": "#2ca02c", "reference": "#9467bd", "critic": "#17becf",
                "actor": "#e377c2"}
LINE_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                "#bcbd22", "#17becf")
_installed = False


def install() -> None:
    """Register the RL page, the identity route and the role colours in this process (once)."""
    global _installed
    if _installed:
        return
    import dask

    try:
        from distributed.dashboard.scheduler import applications
    except ImportError as error:  # no bokeh: Dask serves no dashboard pages at all, ours included
        logger.warning("dask-rl: no dashboard pages (%s): pip install 'bokeh>=3.1'; /metrics still has the "
                       "dask_rl_* figures", error)
    else:
        applications[PAGE] = rl_page
    # Tornado takes the first route that matches: ours goes before distributed's json routes.
    routes = list(dask.config.get("distributed.scheduler.http.routes"))
    if ROUTES_MODULE not in routes:
        dask.config.set({"distributed.scheduler.http.routes": [ROUTES_MODULE, *routes]})
    _colour_task_stream_by_role()
    # distributed's RoutingApplication adds its /sitemap.json handler itself, ahead of every
    # configured route, by this module-level name: no setting reaches it, so the class is
    # replaced here, before the scheduler builds its HTTP server.
    routing.DirectoryHandler = SitemapJSON
    _installed = True


def dask_setup(scheduler) -> None:
    """Preload hook (run as the scheduler starts): the monitor collects from the first event on."""
    scheduler.add_plugin(RLMonitor(), name=NAME, idempotent=True)


def _colour_task_stream_by_role() -> None:
    # The task stream asks this table for each rectangle's colour; Dask offers no setting for
    # it, so the compute entry is wrapped: role tasks get their role's hue, others Dask's.
    from dask.utils import key_split
    from distributed.diagnostics import task_stream

    dask_colour = task_stream.colors["compute"]

    def colour(msg):
        if msg.get("status") == "OK":
            role = key_split(msg.get("key")).split("-", 1)[0]
            if role in ROLE_COLOURS:
                return ROLE_COLOURS[role]
        return dask_colour(msg)

    task_stream.colors["compute"] = colour


# -- a JSON route that survives the scheduler's own identity ---------------------------------
def jsonable(value):
    """`value` with every mapping key a string, so json can write it."""
    if isinstance(value, dict):
        return {k if isinstance(k, str) else "-".join(map(str, k)) if isinstance(k, tuple) else str(k): jsonable(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v) for v in value]
    return value


class IdentityJSON(RequestHandler):
    """`/json/identity.json`, which in distributed answers 500 while tasks run: each worker's
    last heartbeat metrics hold fine-performance digests keyed by tuples, which json refuses
    (the traceback lands in the training's terminal, where the scheduler runs)."""

    def get(self):
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(jsonable(self.server.identity()), default=str))


routes = [("json/identity.json", IdentityJSON, {})]


class SitemapJSON(routing.DirectoryHandler):
    """`/sitemap.json`, which in distributed answers 500 whenever the dashboard runs: it tells
    Bokeh's application apart by "bokeh" in its repr, which DaskBokehTornado's lacks, then
    walks Bokeh's static routes and fails on their missing `path`. Same listing, no crash."""

    def get(self):
        from bokeh.server.tornado import BokehTornado

        paths: set[str] = set()
        for app in [*self.application.applications, self.application]:
            if isinstance(app, BokehTornado):
                paths.update(app.app_paths)
            else:
                _walk(app.default_router, set(), paths)
        self.write({"paths": sorted(paths)})


def _walk(router, seen: set, paths: set) -> None:
    import os

    from tornado.routing import PathMatches, RuleRouter
    from tornado.web import StaticFileHandler

    if id(router) in seen:
        return
    seen.add(id(router))
    for rule in [*router.named_rules.values(), *router.rules]:
        target = rule.target
        if isinstance(rule.matcher, PathMatches):
            pattern = rule.matcher.regex.pattern.rstrip("$")
            root = rule.target_kwargs.get("path") if isinstance(target, type) and issubclass(
                target, StaticFileHandler) else None
            if root:  # each file a static route serves, as distributed lists them
                prefix = pattern.removesuffix("(.*)").rstrip("/")
                paths.update(f"{prefix}/{os.path.relpath(os.path.join(d, f), root)}".replace("\\", "/")
                             for d, _, files in os.walk(root) for f in files)
            else:
                paths.add(pattern)
        if isinstance(target, RuleRouter):
            _walk(target, seen, paths)


# -- the page ------------------------------------------------------------------------------
def rl_page(scheduler, extra, doc) -> None:
    from distributed.dashboard.components.scheduler import BOKEH_THEME, env

    page = RLPage(scheduler)
    page.update()
    doc.add_periodic_callback(page.update, 1000)
    doc.add_root(page.root)
    doc.title = "Dask: RL training"
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME


class RLPage:
    """One browser tab's view: Bokeh models fed from the monitor once a second."""

    def __init__(self, scheduler):
        from bokeh.layouts import column, row
        from bokeh.models import ColumnDataSource, DataTable, Div, NumberFormatter, StringFormatter, TableColumn

        self.scheduler = scheduler
        self.run, self.shown, self.columns, self.events_seen, self.failed = None, 0, set(), None, False
        self.steps = ColumnDataSource(self._empty(), name="dask-rl-steps")
        self.workers = ColumnDataSource({k: [] for k in WORKER_COLUMNS}, name="dask-rl-workers")
        self.samples = ColumnDataSource({k: [] for k in SAMPLE_COLUMNS}, name="dask-rl-samples")
        self.events = ColumnDataSource({k: [] for k in EVENT_COLUMNS}, name="dask-rl-events")
        self.header = Div(text="No dask-rl training has reported to this scheduler yet.", name="dask-rl-header")
        self.reward = self._figure("Reward: mean and spread (± std)", "reward")
        self.reward.varea("step", "reward_low", "reward_high", source=self.steps, fill_alpha=0.25, color="#2ca02c")
        self.reward.line("step", "reward_mean", source=self.steps, line_width=2, color="#2ca02c", legend_label="mean")
        self.kl = self._figure("KL to the reference", "kl_mean")
        self.kl.line("step", "kl_mean", source=self.steps, line_width=2, color="#9467bd")
        self.lag = self._figure("Policy-version lag of consumed samples", "versions")
        self.lag.scatter("step", "staleness", source=self.steps, size=6, color="#ff7f0e")
        self.lag.line("step", "staleness", source=self.steps, color="#ff7f0e")
        self.losses = self._figure("Losses and update statistics", "value")
        self.throughput = self._figure("Tokens/s per role (per second of the role's task compute)", "tokens/s")
        self.components = self._figure("Each reward's mean, and held-out evaluation", "value")

        def table(source, columns, height):
            return DataTable(source=source, height=height, sizing_mode="stretch_width", index_position=None,
                             columns=[TableColumn(field=f, title=t, width=w, formatter=NumberFormatter(format=number[0])
                                                  if number else StringFormatter()) for f, t, w, *number in columns])

        self.root = column(
            self.header, row(self.reward, self.kl, self.lag, sizing_mode="stretch_width"),
            row(self.losses, self.throughput, self.components, sizing_mode="stretch_width"),
            Div(text="<b>Role workers</b>"), table(self.workers, WORKER_TABLE, 240),
            Div(text="<b>Latest samples</b>"), table(self.samples, SAMPLE_TABLE, 150),
            Div(text="<b>Scaling, OOM-backoff and fault events</b>"), table(self.events, EVENT_TABLE, 200),
            sizing_mode="stretch_width")

    @staticmethod
    def _figure(title: str, y_label: str):
        from bokeh.plotting import figure

        fig = figure(title=title, height=260, sizing_mode="stretch_width", x_axis_label="step",
                     y_axis_label=y_label, tools="pan,wheel_zoom,box_zoom,reset,hover")
        fig.toolbar.logo = None
        return fig

    @staticmethod
    def _empty() -> dict[str, list]:
        return {k: [] for k in ("step", "policy_version", "reward_mean", "reward_low", "reward_high", "kl_mean",
                                "staleness", "tokens_per_second")}

    # -- refreshing --------------------------------------------------------------------------
    def update(self) -> None:
        # Runs on the scheduler's event loop, where the training's terminal is: a failure here
        # is one log line, not a traceback a second. Each part refreshes on its own, so a figure
        # that cannot be drawn does not freeze the tables below it.
        monitor = self.scheduler.plugins.get(NAME)
        if monitor is None:
            return
        for part in (self._update_workers, self._update_steps, self._update_tables):
            try:
                part(monitor)
            except Exception as error:
                if not self.failed:
                    logger.warning("dask-rl: the RL dashboard page could not refresh (%s): %r", part.__name__, error)
                self.failed = True

    def _update_workers(self, monitor: RLMonitor) -> None:
        _replace(self.workers, _columns(WORKER_COLUMNS, [_worker_row(w) for w in monitor.workers()]))

    def _update_tables(self, monitor: RLMonitor) -> None:
        if self.events_seen != (len(monitor.events), monitor.changes):
            self.events_seen = (len(monitor.events), monitor.changes)
            _replace(self.events, _columns(EVENT_COLUMNS, [_event_row(e) for e in reversed(monitor.events)]))
            _replace(self.samples, _columns(SAMPLE_COLUMNS, monitor.samples))

    def _update_steps(self, monitor: RLMonitor) -> None:
        steps = list(monitor.steps)
        reset = monitor.run != self.run or self.shown > len(steps)
        if reset:
            self.run, self.shown = monitor.run, 0
        new = [_step_row(s) for s in steps[self.shown:]]
        if not new and not reset:
            return
        wanted = set(self._empty()) | self.columns | set().union(*new)
        if reset or wanted != set(self.steps.data):  # a new run or new series (a new loss): resend all
            # Columns of earlier series stay (as NaN): their lines keep a column to read.
            self.steps.data = _columns(sorted(wanted), [_step_row(s) for s in steps])
            self._add_lines(wanted - set(self._empty()) - self.columns)
        else:
            self.steps.stream(_columns(list(self.steps.data), new))
        if not steps:
            return
        self.shown = len(steps)
        last = steps[-1]
        self.header.text = (f"<b>Run {monitor.run}</b> ({monitor.run_info.get('algorithm', '?')}, roles "
                            f"{', '.join(monitor.run_info.get('roles', []))}): step {last.get('step')}, policy "
                            f"version {last.get('policy_version')}, {last.get('tokens_per_second', 0):.0f} "
                            f"generated tokens/s, last step {last.get('seconds', 0):.2f}s")

    def _add_lines(self, columns: set[str]) -> None:
        self.columns |= columns
        for column in sorted(columns):
            if column.startswith("loss:"):
                colour = LINE_COLOURS[len(self.losses.renderers) % len(LINE_COLOURS)]
                self.losses.line("step", column, source=self.steps, color=colour, line_width=2,
                                 legend_label=column[5:], name=column)
            elif column.startswith("tps:"):
                role = column[4:]
                self.throughput.line("step", column, source=self.steps, color=ROLE_COLOURS.get(role, "#7f7f7f"),
                                     line_width=2, legend_label=role, name=column)
            elif column.startswith(("rew:", "eval:")):  # a reward's mean a line; evaluations points
                colour = LINE_COLOURS[len(self.components.renderers) % len(LINE_COLOURS)]
                draw = self.components.line if column.startswith("rew:") else self.components.scatter
                draw("step", column, source=self.steps, color=colour, legend_label=column, name=column,
                     **({"line_width": 2} if column.startswith("rew:") else {"size": 8}))
        for fig in (self.losses, self.throughput, self.components):
            if fig.legend:
                fig.legend.location, fig.legend.label_text_font_size = "top_left", "8pt"


WORKER_TABLE = (("role", "role", 70), ("name", "worker", 120), ("address", "address", 170), ("devices", "devices", 60),
                ("gpu_memory", "GPU memory", 110), ("memory", "process memory", 90), ("processing", "tasks", 45, "0"),
                ("status", "status", 70))
SAMPLE_TABLE = (("step", "step", 40, "0"), ("reward", "reward", 60, "0.000"), ("prompt", "prompt", 300),
                ("response", "response", 400))
EVENT_TABLE = (("time", "time", 70), ("kind", "kind", 90), ("role", "role", 70), ("worker", "worker", 110),
               ("reason", "reason", 600))
WORKER_COLUMNS = [c[0] for c in WORKER_TABLE]
SAMPLE_COLUMNS = [c[0] for c in SAMPLE_TABLE]
EVENT_COLUMNS = [c[0] for c in EVENT_TABLE]


def _replace(source, data: dict[str, list]) -> None:
    """New table contents. BokehJS redraws a DataTable only when its row count changes, so
    same-length contents go through an empty table first (two small messages)."""
    if data == source.data:
        return
    lengths = {len(v) for v in source.data.values()}
    if lengths == {len(next(iter(data.values()), []))}:
        source.data = {k: [] for k in data}
    source.data = data


def _columns(names, rows: list[dict]) -> dict[str, list]:
    return {name: [row.get(name, float("nan")) for row in rows] for name in names}


def _step_row(step: dict) -> dict:
    """One plotted point: the record's figures, losses as "loss:NAME", throughput as "tps:ROLE"."""
    nan = float("nan")
    number = lambda v: float(v) if isinstance(v, (int, float)) else nan  # noqa: E731
    mean, std = number(step.get("reward_mean")), number(step.get("reward_std", 0.0))
    row = {"step": number(step.get("step")), "policy_version": number(step.get("policy_version")),
           "reward_mean": mean, "reward_low": mean - std, "reward_high": mean + std,
           "kl_mean": number(step.get("kl_mean")), "staleness": number(step.get("staleness")),
           "tokens_per_second": number(step.get("tokens_per_second"))}
    row.update({f"loss:{k}": number(v) for k, v in (step.get("losses") or {}).items()})
    row.update({f"tps:{role}": number((step.get("role_tokens_per_second") or {}).get(role))
                for role in ROLES if role in (step.get("role_tokens_per_second") or {})})
    row.update({f"rew:{name}": number(stats.get("mean")) for name, stats in (step.get("rewards") or {}).items()})
    row.update({f"eval:{key[5:]}": number(value) for key, value in (step.get("evaluation") or {}).items()
                if key in ("eval/accuracy", "eval/pass@1", "eval/reward")})
    return row


def _worker_row(worker: dict) -> dict:
    from dask.utils import format_bytes

    used, total = worker.get("gpu_memory_used"), worker.get("gpu_memory_total")
    gpu = "-" if used is None else format_bytes(used) + (f" / {format_bytes(total)}" if total else "")
    return {**worker, "gpu_memory": gpu, "memory": format_bytes(worker.get("memory") or 0)}


def _event_row(event: dict) -> dict:
    details = {k: v for k, v in event.items() if k not in ("time", "kind", "reason", "role", "worker")}
    reason = str(event.get("reason", "")) + (f" {details}" if details else "")
    return {"time": time.strftime("%H:%M:%S", time.localtime(event.get("time", 0))), "kind": event.get("kind", ""),
            "role": event.get("role", ""), "worker": event.get("worker", ""), "reason": reason}


install()  # importing this module (as a preload) is what installs it

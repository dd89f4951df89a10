"""Watching a run: the RL page in a headless Chromium, the scheduler's RL figures, `/metrics`,
every dashboard route during a run, role colours in the task stream, and where the cluster
listens (on the shared CPU cluster); a lost worker's fault event (a cluster of its own); GPU
memory per role worker (`-m gpu`)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import psutil
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from headless_browser import NO_CHROMIUM, Browser, artifact_dir, find_chromium  # tests/pipeline/headless_browser.py
from pipeline import events
from pipeline.dashboard import PAGE, ROLE_COLOURS
from pipeline.models import load_tokenizer
from pipeline.monitor import NAME
from pipeline.records import Rollout
from pipeline.rewards import digit_fraction
from pipeline.fleet.tasks import submit
from pipeline.trainer import HybridTrainer
from resources.allocator import OUT_OF_MEMORY, report

SMALL = dict(prompts_per_step=8, max_new_tokens=8, actor_lr=1e-3, critic_lr=1e-3, micro_batch_size=8,
             show_progress=False)
WATCHED = ("tornado", "tornado.application", "bokeh", "distributed", "dask_rl")
# distributed's ProfileTimePlot asks for the profile asynchronously and then calls its
# document through a weak reference; a plain GET of a profile page (what these tests do, not
# what a browser does) drops that document first, and the answer logs this AttributeError.
# It is Dask's own race, and says nothing of the routes or the RL page.
DISCARDED_DOCUMENT = "'NoneType' object has no attribute 'add_next_tick_callback'"


class ErrorLog(logging.Handler):
    """Errors (and tracebacks) that the dashboard's server code logs in this, the scheduler's, process."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []
        self.unresponsive: list[str] = []  # Dask's "event loop was unresponsive" warnings, for diagnosis

    def emit(self, record):
        if "unresponsive" in record.getMessage():
            self.unresponsive.append(record.getMessage()[:120])
        elif DISCARDED_DOCUMENT in record.getMessage() or DISCARDED_DOCUMENT in str(record.exc_info and record.exc_info[1]):
            pass  # Dask's profile plot answering a document already dropped (see DISCARDED_DOCUMENT)
        elif record.levelno >= logging.ERROR or record.exc_info or "dashboard" in record.getMessage():
            self.records.append(record)

    def __enter__(self):
        for name in WATCHED:  # tornado.application and bokeh do not propagate: attach to each
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc):
        for name in WATCHED:
            logging.getLogger(name).removeHandler(self)


def _in_ci() -> bool:
    """CI services set CI=true (GitHub Actions, GitLab, most others); .ci/run does too."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def fetch(url: str) -> tuple[int | str, str]:
    """(status, body); a route that did not answer at all gives the reason as its status."""
    try:
        with urllib.request.urlopen(url, timeout=60) as answer:
            return answer.status, answer.read().decode(errors="replace")
    except urllib.error.HTTPError as error:
        return error.code, ""
    except OSError as error:  # no answer in time, or the connection dropped
        return repr(error), ""


def concrete_routes(base: str, client) -> list[str]:
    """Every GET route of the sitemap, patterns filled with a live worker or task."""
    status, body = fetch(base + "/sitemap.json")
    assert status == 200, "/sitemap.json must answer (distributed's own handler fails on the Bokeh routes)"
    import json

    worker = urllib.parse.quote(next(iter(client.scheduler_info()["workers"])), safe="")
    task = urllib.parse.quote(str(next(iter(client.run_on_scheduler(_task_keys) or ["none"]))), safe="")
    routes = []
    for path in json.loads(body)["paths"]:
        if path in ("/eventstream", "/hardware") or path.startswith("/proxy") or path.endswith((".py", ".pyc", ".map")):
            # a websocket, a page that benchmarks every worker's disk and network as it opens,
            # a proxy to other ports, and package files that statics happens to hold
            continue
        if path.startswith("/statics/") and not path.endswith((".css", ".html")):
            continue
        for pattern, value in (("/info/worker/", worker), ("/info/call-stacks/", worker), ("/info/logs/", worker),
                               ("/info/task/", task), ("/info/call-stack/", task)):
            if path.startswith(pattern):
                path = pattern + value + ".html"
        routes.append(path)
    return routes


def _task_keys(dask_scheduler=None):
    return [str(k) for k in list(dask_scheduler.tasks)[:1]]


def _monitor_state(dask_scheduler=None):
    monitor = dask_scheduler.plugins[NAME]
    return {"run": monitor.run, "steps": list(monitor.steps), "samples": monitor.samples,
            "events": list(monitor.events), "workers": monitor.workers()}


def _start_task_stream(dask_scheduler=None):
    from distributed.diagnostics.task_stream import TaskStreamPlugin

    if "task-stream" not in dask_scheduler.plugins:
        dask_scheduler.add_plugin(TaskStreamPlugin(dask_scheduler))


def _task_stream_colours(dask_scheduler=None):
    from distributed.diagnostics.task_stream import rectangles

    shown = rectangles(list(dask_scheduler.plugins["task-stream"].buffer))
    return sorted({(name, colour) for name, colour in zip(shown["name"], shown["color"])})


STEPS_SOURCE = "Bokeh.documents.length && Bokeh.documents[0].get_model_by_name('dask-rl-steps')"
# A source's columns as plain arrays (BokehJS may hold them as typed arrays).
COLUMNS = ("(name => {{ const d = Bokeh.documents[0].get_model_by_name(name).data; const out = {{}};"
           " for (const k of Object.keys(d)) out[k] = Array.from(d[k]); return out; }})('{}')")


async def _crash():  # a coroutine: client.run need not wait for an answer that never comes
    os._exit(1)  # a worker process dying, as on a segfault or an OOM kill


def test_a_worker_lost_without_retiring_is_a_fault_event_naming_it():
    """A worker process that dies is logged with its name and role; its Nanny restarts it.
    (Before the watched run: the dashboard pages that run fetches keep refreshing on the
    scheduler for 15-30 s after, and on two cores this cluster then took 25 s instead of 5.)"""
    from resources.cluster import RoleCluster
    from resources.plan import WorkerSpec

    worker = WorkerSpec(name="reward-0", role="reward", device_type="cpu", device_id=None, env=())
    with RoleCluster([worker], dashboard_address=":0", preload=["pipeline.dashboard"]) as cluster:
        client = cluster.client
        client.run(_crash, wait=False)

        def faults(dask_scheduler=None):
            return [e for e in dask_scheduler.plugins[NAME].events if e["kind"] == "fault"]

        deadline = time.monotonic() + 60
        while not client.run_on_scheduler(faults) and time.monotonic() < deadline:
            time.sleep(0.2)
        [fault] = client.run_on_scheduler(faults)
        assert fault["worker"] == "reward-0" and fault["role"] == "reward"
        assert fault["reason"].startswith("worker reward-0 left without being retired")


@pytest.fixture(scope="module")
def watched_run(shared_cluster, shared_config, tiny_model, prompts, tmp_path_factory):
    """A 3-step PPO run on the module's cluster while every dashboard route is fetched over and
    over, and the RL page is open in a headless Chromium (where there is one) from the start."""
    client = shared_cluster.client
    client.run_on_scheduler(_start_task_stream)
    base = shared_cluster.dashboard_link.rsplit("/", 1)[0]
    chromium = find_chromium()
    with contextlib.ExitStack() as open_during_the_run:
        trainer = HybridTrainer(tiny_model, digit_fraction, shared_config, algorithm="ppo", prompts=prompts,
                                cluster=shared_cluster, steps=3, **SMALL)
        open_during_the_run.callback(trainer.close)
        with ErrorLog() as errors:
            browser_start = time.monotonic()
            browser = open_during_the_run.enter_context(Browser(chromium)) if chromium else None
            if browser is not None:  # opened before the first step: the points must arrive live
                browser.open(base + PAGE)
                browser.wait_for(f"!!({STEPS_SOURCE})")
            browser_seconds = time.monotonic() - browser_start
            routes = concrete_routes(base, client)
            # A Bokeh page builds its document (and periodic callbacks) at each GET, and the
            # document lives on, refreshing, until Bokeh drops unconnected sessions (15 s): those
            # pages are asked for once, during the run; the plain routes all through it and after.
            plain = [r for r in routes if r.startswith(("/json/", "/info", "/metrics", "/health", "/sitemap",
                                                         "/individual-plots"))]
            statuses: dict[str, set[int]] = {}
            slowest: dict[str, float] = {}  # seconds of each route's slowest answer, to read on a failure
            done = threading.Event()

            def poll(paths):
                for route in paths:
                    start = time.monotonic()
                    statuses.setdefault(route, set()).add(fetch(base + route)[0])
                    slowest[route] = max(slowest.get(route, 0.0), time.monotonic() - start)

            def during_the_run():
                poll(routes)
                while not done.wait(1.0):  # often enough to land in every phase, without crowding
                    poll(plain)

            # One event through the public path before the first step (an unscaled CPU run logs
            # none), so the page's event table gets a row while the run goes on.
            events.emit("fault", "a driver-side event for the RL page", client=client)
            poller = threading.Thread(target=during_the_run)
            poller.start()
            records = trainer.train()
            done.set()
            poller.join(120)
            read_start = time.monotonic()
            page = read_rl_page(browser, client, len(records), tmp_path_factory.mktemp("rl-page")) if browser else None
            browser_seconds += time.monotonic() - read_start
            poll(plain)
        yield {"trainer": trainer, "records": records, "statuses": statuses, "errors": errors.records,
               "base": base, "page": page, "slowest": sorted(slowest.items(), key=lambda kv: -kv[1])[:8],
               "unresponsive": errors.unresponsive,
               "browser_seconds": browser_seconds}


def read_rl_page(browser: Browser, client, steps: int, tmp_path) -> dict:
    """What the open RL page plots once `steps` points arrived, and its screenshot."""
    try:
        browser.wait_for(f"{STEPS_SOURCE}.data.step.length >= {steps}", timeout=60)
        browser.wait_for("Bokeh.documents[0].get_model_by_name('dask-rl-events').data.reason.length > 0",
                         timeout=30)
    except TimeoutError as error:  # what the scheduler held then, to tell the page from the monitor
        state = client.run_on_scheduler(_monitor_state)
        raise AssertionError(f"{error}; the monitor held {len(state['steps'])} steps and these events: "
                             f"{[e['reason'] for e in state['events']]}; the page has "
                             f"{browser.evaluate('Bokeh.documents.length')} Bokeh document(s)") from error
    data = browser.evaluate(f"(() => {{ const d = {STEPS_SOURCE}.data; const out = {{}};"
                            " for (const k of Object.keys(d)) out[k] = Array.from(d[k]); return out; })()")
    tables = browser.evaluate("Object.fromEntries(['dask-rl-workers', 'dask-rl-samples', 'dask-rl-events']"
                              ".map(n => [n, Bokeh.documents[0].get_model_by_name(n).data]))")
    lines = browser.evaluate("Bokeh.documents[0].all_models ? [...Bokeh.documents[0].all_models]"
                             ".filter(m => m.type === 'GlyphRenderer').length : 0")
    screenshot = browser.screenshot(tmp_path / "rl-page.png")
    return {"data": data, "tables": tables, "renderers": lines, "screenshot": screenshot,
            "copy": shutil.copy(screenshot, artifact_dir() / "rl-page.png")}


def test_every_dashboard_route_answers_during_a_run_without_logging_errors(watched_run):
    statuses = watched_run["statuses"]
    assert len(statuses) > 40
    assert {"/json/identity.json", "/sitemap.json", "/metrics", PAGE, "/status"} <= set(statuses)
    # A task may be gone by the time its page is asked for: 404 is the right answer then.
    bad = {route: codes for route, codes in statuses.items()
           if codes - ({200, 404} if route.startswith(("/info/task/", "/info/call-stack/")) else {200})}
    assert bad == {}, (f"slowest routes (s): {watched_run['slowest']}; the scheduler's loop said: "
                       f"{watched_run['unresponsive']}")
    assert [f"{r.name}: {r.getMessage()}" for r in watched_run["errors"]] == []


def test_the_rl_page_in_a_headless_browser_plots_the_live_run(watched_run, measured):
    page = watched_run["page"]
    if page is None:
        if _in_ci():  # a skip there would let a broken RL page through: .ci/run installs Chromium
            pytest.fail(f"CI={os.environ['CI']}: {NO_CHROMIUM}")
        pytest.skip(NO_CHROMIUM)
    records, trainer = watched_run["records"], watched_run["trainer"]
    data = page["data"]
    # The page was open before the first step: these points came over its websocket.
    assert data["step"] == [r.step for r in records] == [0, 1, 2]
    assert data["reward_mean"] == pytest.approx([r.reward_mean for r in records])
    assert data["reward_high"] == pytest.approx([r.reward_mean + r.reward_std for r in records])
    assert data["kl_mean"] == pytest.approx([r.kl_mean for r in records])
    assert data["staleness"] == [0, 0, 0]
    assert data["loss:policy_loss"] == pytest.approx([r.losses["policy_loss"] for r in records])
    assert data["loss:value_loss"] == pytest.approx([r.losses["value_loss"] for r in records])
    for role in trainer.roles:
        assert all(value > 0 for value in data[f"tps:{role}"])
    tables = page["tables"]
    assert sorted(tables["dask-rl-workers"]["name"]) == sorted(trainer.fleet.cluster.specs)
    assert set(tables["dask-rl-workers"]["devices"]) == {"cpu"}
    assert len(tables["dask-rl-samples"]["prompt"]) == 4 and set(tables["dask-rl-samples"]["step"]) == {2}
    assert any("a driver-side event for the RL page" in reason for reason in tables["dask-rl-events"]["reason"])
    assert page["renderers"] >= 5  # reward band and line, KL, lag, a loss line, a throughput line
    png = page["screenshot"].read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000
    measured(f"RL page screenshot: {page['copy']} (also {page['screenshot']}); Chromium's part of the run "
             f"(start, load, read, screenshot): {watched_run['browser_seconds']:.1f}s")


def test_the_rl_page_is_listed_for_the_dashboard_menu_and_dask_labextension(watched_run):
    import json

    status, body = fetch(watched_run["base"] + "/individual-plots.json")
    assert status == 200 and json.loads(body)["Individual Rl Training"] == PAGE
    status, page = fetch(watched_run["base"] + PAGE)
    assert status == 200 and "bokeh" in page.lower()


def test_metrics_export_the_runs_figures_labelled_by_role(watched_run):
    records, trainer = watched_run["records"], watched_run["trainer"]
    status, text = fetch(watched_run["base"] + "/metrics")
    assert status == 200
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("dask_rl_"):
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    last = records[-1]
    value = lambda metric, **labels: samples[(f"dask_rl_{metric}", tuple(sorted(labels.items())))]  # noqa: E731
    assert value("step") == last.step and value("policy_version") == last.policy_version == 3
    assert value("reward_mean") == pytest.approx(last.reward_mean)
    assert value("reward_std") == pytest.approx(last.reward_std) and last.reward_std > 0
    assert value("kl_mean") == pytest.approx(last.kl_mean)
    assert value("staleness") == last.staleness == 0
    assert value("loss", name="policy_loss") == pytest.approx(last.losses["policy_loss"])
    assert value("loss", name="value_loss") == pytest.approx(last.losses["value_loss"])
    assert value("steps_total") >= 3
    for role in trainer.roles:  # every role did work in the last step, so each has a throughput
        assert value("role_tokens_per_second", role=role) > 0
    assert value("role_workers", role="actor") == 2 and value("role_workers", role="rollout") == 2
    assert value("worker_memory_bytes", role="reward", worker="reward-0") > 10 * 2**20
    assert last.rewards  # each reward's figures, labelled by its name
    for name, stats in last.rewards.items():
        assert value("rewards_mean", name=name) == pytest.approx(stats["mean"])
        assert value("rewards_std", name=name) == pytest.approx(stats["std"])


def test_the_scheduler_holds_the_runs_steps_samples_and_workers(watched_run, prompts):
    trainer, records = watched_run["trainer"], watched_run["records"]
    state = trainer.fleet.client.run_on_scheduler(_monitor_state)
    assert state["run"] == trainer.run_id
    assert [s["step"] for s in state["steps"]] == [r.step for r in records]
    assert [s["reward_mean"] for s in state["steps"]] == pytest.approx([r.reward_mean for r in records])
    assert len(state["samples"]) == 4 and {s["step"] for s in state["samples"]} == {records[-1].step}
    for sample in state["samples"]:  # decoded as the reward role decodes them: the reward recomputes
        assert sample["prompt"] in prompts
        assert sample["reward"] == pytest.approx(digit_fraction(sample["prompt"], sample["response"]))
    assert {w["name"] for w in state["workers"]} == set(trainer.fleet.cluster.specs)
    assert {w["role"] for w in state["workers"]} == set(trainer.roles)
    assert all(w["devices"] == "cpu" and w["memory"] > 0 for w in state["workers"])


def test_task_stream_colours_tell_the_roles_apart(watched_run):
    colours = watched_run["trainer"].fleet.client.run_on_scheduler(_task_stream_colours)
    by_role: dict[str, set[str]] = {}
    for name, colour in colours:
        role = name.split("-", 1)[0]
        if role in ROLE_COLOURS:  # compute rectangles; transfers are "transfer-<key prefix>" in red
            by_role.setdefault(role, set()).add(colour)
    assert by_role == {role: {ROLE_COLOURS[role]} for role in watched_run["trainer"].roles}
    assert len(set(ROLE_COLOURS.values())) == len(ROLE_COLOURS)


def test_events_from_workers_and_the_driver_reach_the_event_log(shared_cluster):
    client = shared_cluster.client
    events.emit("fault", "a driver-side test event", client=client, detail=3)
    submit(client, "critic", _emit_on_worker, tag="events").result()

    def logged(dask_scheduler=None):
        return [e for e in dask_scheduler.plugins[NAME].events if "test event" in e["reason"]][-3:]

    driver, worker, degraded = client.run_on_scheduler(logged)
    assert driver["kind"] == "fault" and driver["detail"] == 3 and "worker" not in driver
    assert worker["kind"] == "oom-backoff" and worker["role"] == "critic" and worker["worker"].startswith("critic-")
    assert worker["rows"] == 2
    # The allocator's degradation events (resources.allocator.report) are on the page too.
    assert degraded["kind"] == "oom-backoff" and degraded["worker"] == worker["worker"]
    assert degraded["reason"] == ("critic: optimizer step: 8 -> 4 rows per micro-batch (out of memory: a test event: "
                                  "CUDA out of memory)")


def _emit_on_worker():
    events.emit("oom-backoff", "a worker-side test event", rows=2)
    report("optimizer step", 8, 4, "rows per micro-batch", OUT_OF_MEMORY, "a test event: CUDA out of memory")


def test_events_never_raise_into_the_training(shared_cluster):
    # Unserialisable, or no usable client: the message is dropped, the caller carries on.
    assert events.publish(events.EVENTS, {"x": object()}, client=shared_cluster.client) is False
    assert events.publish(events.EVENTS, {"x": 1}, client=object()) is False
    assert events.publish(events.EVENTS, {"x": 1}, client=shared_cluster.client) is True
    assert events.plain({"t": torch.tensor(2.5), (1, 2): float("nan"), "n": [1, torch.tensor(3)]}) == \
        {"t": 2.5, "(1, 2)": None, "n": [1, 3]}


def test_a_workers_role_label_names_its_roles_and_splits_back_into_them():
    """role_of joins a worker's roles (an actor hosting the rollout carries both), roles_in
    splits the label again, its own role first: the RL page's order and role_workers read it."""
    assert events.role_of({"actor": 1, "rollout": 1, "GPU": 1}) == "actor+rollout"
    assert events.roles_in("actor+rollout") == ["actor", "rollout"]
    assert events.roles_in(events.role_of({"reward": 1})) == ["reward"]
    assert events.roles_in(events.role_of({"GPU": 1})) == [""]   # no role: one empty name


def test_decode_samples_decodes_prompt_and_response_without_padding(tiny_model):
    tokenizer = load_tokenizer(tiny_model)
    pad = tokenizer.pad_token_id
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    p1, p2, r1, r2 = encode("ab"), encode("abc"), encode("12"), encode("x")
    input_ids = torch.tensor([[pad, *p1, *r1], [*p2, *r2, pad]])
    rollout = Rollout(input_ids=input_ids, attention_mask=(input_ids != pad).long(),
                      response_mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]]), behavior_logprobs=torch.zeros(2, 2),
                      group_ids=torch.tensor([0, 1]), policy_version=0, prompt_length=3)
    samples = events.decode_samples(tokenizer, rollout, torch.tensor([1.0, 0.0]), n=4)
    assert samples == [{"row": 0, "prompt": "ab", "response": "12", "reward": 1.0},
                       {"row": 1, "prompt": "abc", "response": "x", "reward": 0.0}]
    assert [s["row"] for s in events.decode_samples(tokenizer, rollout, torch.tensor([1.0, 0.0]), n=1)] == [0]


@pytest.mark.slow  # over 20 s on 2 cores: the slow suite (CI runs it) keeps the default one short
def test_the_scheduler_dashboard_and_workers_listen_on_localhost_only(shared_cluster):
    """The default: nothing of the cluster is reachable from other machines."""
    client = shared_cluster.client
    identity = client.run_on_scheduler(lambda dask_scheduler=None: {
        "scheduler": dask_scheduler.address, "dashboard": dask_scheduler.services["dashboard"].port,
        "workers": {a: (ws.nanny, ws.services.get("dashboard")) for a, ws in dask_scheduler.workers.items()}})
    ports = {int(identity["scheduler"].rsplit(":", 1)[1]), identity["dashboard"]}
    for address, (nanny, dashboard) in identity["workers"].items():
        ports |= {int(address.rsplit(":", 1)[1]), int(nanny.rsplit(":", 1)[1]), dashboard}
    pids = {psutil.Process().pid, *client.run(lambda: psutil.Process().pid).values(),
            *client.run(lambda: psutil.Process().ppid()).values()}  # the workers and their Nannies
    listening = [c for pid in pids for c in psutil.Process(pid).net_connections("inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port in ports]
    assert {c.laddr.port for c in listening} == ports
    assert {c.laddr.ip for c in listening} == {"127.0.0.1"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_metrics_and_the_worker_table_show_gpu_memory_per_role_on_a_gpu(tiny_model, prompts):
    """`pytest -m gpu`: rollout and actor on GPU 0, reward on CPU; NVML's figures per role worker."""
    from resources import load_resource_config

    config = load_resource_config({"actor": {"device_type": "cuda", "device_ids": [0]},
                                   "rollout": {"device_type": "cuda", "device_ids": [0], "strategy": "hf"},
                                   "reward": {"device_type": "cpu", "workers": 1}, "allow_shared_devices": True,
                                   "timeout_seconds": 300})
    with HybridTrainer(tiny_model, digit_fraction, config, algorithm="grpo", prompts=prompts, steps=2,
                       kl_coef=0.0, samples_per_prompt=2, dashboard_address=":0", **SMALL) as trainer:
        trainer.train()
        base = trainer.fleet.cluster.dashboard_link.rsplit("/", 1)[0]
        gpu = {}
        for _ in range(20):  # NVML figures ride on the workers' heartbeats
            status, text = fetch(base + "/metrics")
            assert status == 200
            gpu = {(s.labels["role"], s.labels["devices"]): s.value for family in text_string_to_metric_families(text)
                   for s in family.samples if s.name == "dask_rl_worker_gpu_memory_used_bytes"}
            if len(gpu) == 2:
                break
            time.sleep(1)
        assert set(gpu) == {("actor", "0"), ("rollout", "0")} and min(gpu.values()) > 0
        workers = {w["role"]: w for w in trainer.fleet.client.run_on_scheduler(_monitor_state)["workers"]}
        assert workers["actor"]["devices"] == "0" and workers["reward"]["devices"] == "cpu"
        assert workers["actor"]["gpu_memory_total"] > workers["actor"]["gpu_memory_used"] > 0
        # The CPU reward worker sees GPU 0 too: Dask's NVML figures are not its memory.
        assert workers["reward"]["gpu_memory_used"] is None and workers["reward"]["gpu_memory_total"] is None

"""`dask-rl run FILE` trains from a run file; `dask-rl worker` joins a running training;
`dask-rl scheduler` runs a scheduler that trainers and workers on other hosts join."""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from dataclasses import replace
from pathlib import Path


class _Parser(argparse.ArgumentParser):
    """argparse, with its usage errors on one line like every other error of the command."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message}. Fix: see `{self.prog} --help`.\n")


def _bounded(kind: type, low: float, high: float, what: str):
    """An argparse type: a `kind` from `low` to `high`, the same limits as the run and resource
    files (a wrong one is one line naming the flag, the limit and the fix)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not low <= value <= high:  # nan fails this too
            raise argparse.ArgumentTypeError(f"{text} is not {what} from {low} to {high}")
        return value
    parse.__name__ = what  # argparse names the type in some messages
    return parse


def _seconds():
    from resources.validate import MAX_TIMEOUT_SECONDS

    return _bounded(float, 1e-3, MAX_TIMEOUT_SECONDS, "a number of seconds")


def _workers(low: int = 1):
    from resources.validate import MAX_ROLE_WORKERS

    return _bounded(int, low, MAX_ROLE_WORKERS, "a number of workers")


_GPU_ID = _bounded(int, 0, 2**31 - 1, "a GPU id (NVML index)")
_PORT = _bounded(int, 0, 65535, "a TCP port")


def main(argv: list[str] | None = None) -> int:
    """Every error ends the command with one line on stderr naming the cause (and the fix,
    where the error knows it) and exit status 2; `--debug` prints the traceback too."""
    parser = _Parser(prog="dask-rl", description=__doc__)
    from pipeline import __version__

    parser.add_argument("--version", action="version", version=f"dask-rl {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="train from a run file (resources + train section)")
    run.add_argument("file", help="run file, e.g. examples/quickstart.yaml")
    run.add_argument("--steps", type=int, help="override train.steps")
    run.add_argument("--output-dir", help="where the trained models, checkpoints, metrics and samples go")
    _add_listen_flags(run, "the scheduler, its dashboard and the workers")
    run.add_argument("--scheduler-address", help="train on a running `dask-rl scheduler` and its `dask-rl worker`s")
    _add_tls_flags(run)
    run.add_argument("--resume", nargs="?", const=True, metavar="DIR",
                     help="continue from the newest valid checkpoint under DIR (default: the output directory)")
    run.add_argument("--sample-every", type=_bounded(int, 0, 2**31 - 1, "a number of steps"), default=10, metavar="N",
                     help="print one prompt/response/reward every N steps (0: never)")
    _add_cluster_commands(commands)
    for command in (parser, *commands.choices.values()):  # `dask-rl --debug run f` and `dask-rl run f --debug`
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="on an error, print its traceback too")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        print(f"dask-rl {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 - the one place every error becomes one line
        if getattr(args, "debug", False):
            traceback.print_exc()
        print(f"dask-rl {args.command}: {one_line(error)}", file=sys.stderr)
        return 2


# Errors whose message is written for the user (it names the key or value and the fix):
# shown as they are; any other is shown with its type, which says what failed.
_USER_ERRORS = (ValueError, KeyError, TimeoutError, ConnectionError, FileNotFoundError, ImportError)


def one_line(error: BaseException, limit: int = 1000) -> str:
    """`error` as one line of at most `limit` characters, ending with a fix."""
    text = error.args[0] if type(error) is KeyError and error.args else error  # KeyError's str() quotes it
    message = " ".join(str(text).split())
    if not isinstance(error, _USER_ERRORS) or not message:
        message = f"{type(error).__name__}: {message}" if message else type(error).__name__
    if "Fix:" not in message:
        message += ". Fix: rerun with --debug for the traceback, and check the workers' logs on the dashboard"
    return message if len(message) <= limit else message[:limit - 3] + "..."


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "run":
        return run_file(args.file, steps=args.steps, output_dir=args.output_dir,
                        dashboard_address=args.dashboard_address, scheduler_address=args.scheduler_address,
                        resume=args.resume, sample_every=args.sample_every, host=args.host,
                        security=security_from(args))
    if args.command == "worker":
        return run_worker(args)
    if args.command == "scheduler":
        return run_scheduler(args)
    if args.command == "scale":
        return run_scale(args)
    return 2


def _add_listen_flags(parser, what: str) -> None:
    parser.add_argument("--host", default="127.0.0.1",
                        help=f"interface {what} listen on (default 127.0.0.1, this machine only; 0.0.0.0: every "
                             f"interface, for workers or browsers on other hosts)")
    parser.add_argument("--dashboard-address", default=":8787",
                        help="dashboard [HOST]:PORT (default :8787; without a host it follows --host)")


def _add_tls_flags(parser) -> None:
    tls = parser.add_argument_group("TLS", "encrypt and authenticate every connection with mutual TLS (the CA "
                                           "file and a certificate signed by it; README: multi-host runs)")
    tls.add_argument("--tls-ca-file", help="PEM file of the CA that signed every participant's certificate")
    tls.add_argument("--tls-cert", help="PEM certificate of this process (may hold the key too)")
    tls.add_argument("--tls-key", help="PEM private key of --tls-cert")


def security_from(args: argparse.Namespace):
    """The Security for the TLS flags, or None without them."""
    if not (args.tls_ca_file or args.tls_cert):
        return None
    if not (args.tls_ca_file and args.tls_cert):
        print("dask-rl: TLS needs both --tls-ca-file and --tls-cert (and --tls-key unless the cert file holds "
              "the key). Fix: give the CA file and this host's certificate", file=sys.stderr)
        raise SystemExit(2)
    from resources.cluster import tls_security

    return tls_security(args.tls_ca_file, args.tls_cert, args.tls_key)


def _add_cluster_commands(commands) -> None:
    """`dask-rl worker` and `dask-rl scheduler`: a training spread over several hosts."""
    worker = commands.add_parser(
        "worker", help="join a scheduler as role workers: one per GPU, or --workers N on CPU",
        description="Join a running scheduler (`dask-rl scheduler` or a trainer's own) as role-tagged workers.")
    worker.add_argument("address", help="the scheduler, e.g. tcp://host-a:8786")
    worker.add_argument("--role", required=True, help="actor, critic, reference, reward or rollout")
    worker.add_argument("--device-ids", type=_GPU_ID, nargs="+", metavar="ID",
                        help="GPUs (NVML index) to start one worker each on; leave out for CPU workers")
    worker.add_argument("--workers", type=_workers(), help="number of CPU workers (default 1; not with --device-ids)")
    worker.add_argument("--name", help="worker name (default {role}-{hostname}-gpu{id} or {role}-{hostname}-{k})")
    worker.add_argument("--nthreads", type=_bounded(int, 1, 1024, "a number of threads"), default=1,
                        help=argparse.SUPPRESS)
    worker.add_argument("--allow-busy", action="store_true", help="start even on a GPU NVML reports busy")
    worker.add_argument("--timeout", type=_seconds(), default=30.0, help="seconds to reach the scheduler")
    worker.add_argument("--host", help="interface the workers listen on (default: every interface, since the "
                                       "scheduler and other hosts' workers connect to them)")
    _add_tls_flags(worker)
    scale = commands.add_parser("scale", help="change a role of a running training (update_resource from a shell)",
                                description="Ask the trainer running on this scheduler to change one role; "
                                            "it applies the change at its next step boundary.")
    scale.add_argument("address", help="the training's scheduler, e.g. tcp://host-a:8786")
    scale.add_argument("--role", required=True, help="actor, critic, reference, reward or rollout")
    scale.add_argument("--device-ids", type=_GPU_ID, nargs="+", metavar="ID", help="the role's GPUs after the change")
    # --workers 0 is left to the trainer, which says why the last worker of a role cannot go.
    scale.add_argument("--workers", type=_workers(low=0),
                       help="the role's CPU workers after the change")
    scale.add_argument("--jobs", type=_workers(low=0), help="the role's batch jobs after the change (a role on a "
                       "job queue)")
    scale.add_argument("--strategy", help="e.g. data_parallel for reward on several devices")
    scale.add_argument("--device-type", choices=("cuda", "cpu"), help="move the role between GPUs and CPU")
    scale.add_argument("--timeout", type=_seconds(), default=600.0, help="seconds to wait for the trainer's answer")
    _add_tls_flags(scale)
    scheduler = commands.add_parser("scheduler", help="run a scheduler for trainers and `dask-rl worker`s to join",
                                    description="A Dask scheduler with dask-rl's settings.")
    _add_listen_flags(scheduler, "the scheduler and its dashboard")
    scheduler.add_argument("--port", type=_PORT, default=8786)
    scheduler.add_argument("--preload", action="append", default=[], help="module to import in the scheduler")
    _add_tls_flags(scheduler)


def run_scale(args: argparse.Namespace) -> int:
    """`dask-rl scale ADDRESS --role R ...`: prints what changed, or the trainer's error."""
    from resources.worker import check_scheduler

    check_scheduler(args.address)  # nothing listening: one line at once, not Dask's 30 s of retries
    from distributed import Client

    from pipeline.fleet.boundary import send_remote_request

    request = {"component": args.role, "device_ids": args.device_ids, "strategy": args.strategy,
               "workers": args.workers, "device_type": args.device_type, "jobs": args.jobs}
    with Client(args.address, timeout=10, security=security_from(args)) as client:
        answer = send_remote_request(client, request, args.timeout)
    if "error" in answer:
        print(f"dask-rl scale: {answer['error']}", file=sys.stderr)
        return 2
    for change in answer["changes"]:
        print(change)
    return 0


def run_worker(args: argparse.Namespace) -> int:
    """`dask-rl worker ADDRESS --role ROLE [...]`: blocks until Ctrl-C or until retired."""
    from pipeline.roles.host import WORKER_IMPORTS
    from resources.worker import WorkerStartError, start_role_worker

    if args.device_ids and args.workers is not None:
        print("dask-rl worker: --workers is for CPU workers; with --device-ids it is one worker per GPU",
              file=sys.stderr)
        return 2
    try:
        start_role_worker(args.address, args.role, args.device_ids, name=args.name, nthreads=args.nthreads,
                          workers=args.workers or 1, allow_busy=args.allow_busy, timeout=args.timeout,
                          host=args.host, security=security_from(args), imports=WORKER_IMPORTS)
    except WorkerStartError as error:
        print(f"dask-rl worker: {error}", file=sys.stderr)
        return 2
    return 0


def run_scheduler(args: argparse.Namespace) -> int:
    """`dask-rl scheduler`: a distributed Scheduler with the project's Dask settings."""
    import asyncio

    from distributed import Scheduler
    from distributed._signals import wait_for_signals
    from distributed.utils import format_dashboard_link

    from pipeline.monitor import PAGE
    from resources.cluster import configure_dask, listen_address

    configure_dask()  # worker-ttl and the other scheduler-side settings must be set before it starts
    security = security_from(args)
    # The RL page and the monitor: pipeline.dashboard installs them as the scheduler starts.
    preload = ["pipeline.dashboard", *args.preload]

    async def serve() -> None:
        async with Scheduler(host=args.host, port=args.port, preload=preload, security=security,
                             protocol="tls" if security is not None else None,
                             dashboard_address=listen_address(args.dashboard_address, args.host)) as scheduler:
            print(f"dask-rl: scheduler at {scheduler.address}", flush=True)
            if "dashboard" in scheduler.services:
                link = format_dashboard_link(scheduler.address.split("://")[1].rsplit(":", 1)[0],
                                             scheduler.services["dashboard"].port)
                print(f"dask-rl: dashboard at {link}, RL page {link.rsplit('/', 1)[0]}{PAGE}", flush=True)
            print(f"dask-rl: join it with `dask-rl worker {scheduler.address} --role ROLE [--device-ids N]` "
                  f"and HybridTrainer(..., scheduler_address={scheduler.address!r})", flush=True)
            signalled = asyncio.ensure_future(wait_for_signals())
            await asyncio.wait([signalled, asyncio.ensure_future(scheduler.finished())],
                               return_when=asyncio.FIRST_COMPLETED)
            print("dask-rl: scheduler closing", flush=True)

    asyncio.run(serve())
    return 0


def run_file(path: str, *, steps: int | None = None, output_dir: str | None = None,
             dashboard_address: str = ":8787", scheduler_address: str | None = None,
             resume: str | bool | None = None, sample_every: int = 10, host: str = "127.0.0.1",
             security=None) -> int:
    """Train as the run file says; print how the reward moved and where the results are.

    Ctrl-C or SIGTERM ends the run after the step in flight (a checkpoint is written when
    train.checkpoint is set, the models are saved, the cluster closed); exit 130 / 143. A
    second Ctrl-C exits at once.
    """
    if scheduler_address is not None:
        from resources.worker import check_scheduler

        check_scheduler(scheduler_address)  # first: nothing listening there is one line at once
    import tempfile

    from pipeline.config import TrainConfigError, make_train_config
    from pipeline.run_file import load_run_file
    from pipeline.data import read_rows
    from pipeline.rewards import resolve_reward_function
    from resources.config import ResourceConfigError, shorten

    # A bad file is the user's to fix: one line naming the key and the fix, no traceback, and
    # at once: torch and Dask are imported only after the file has been checked.
    try:
        run = load_run_file(path)
        if run.resources.role("rollout").strategy == "vllm":
            from pipeline.engines.vllm import require_vllm

            require_vllm()  # the local workers run this Python: fail before they start
        if steps is not None:
            run = replace(run, train=make_train_config({"steps": steps}, source="--steps", base=run.train))
        inputs = dict(run.inputs)
        functions = inputs.get("reward_function", [])
        rewards = [_reward_function(spec, resolve_reward_function)
                   for spec in (functions if isinstance(functions, list) else [functions])]
        rewards += [inputs["reward_model"]] if "reward_model" in inputs else []
        if not rewards:
            raise TrainConfigError(f"{path}: train: no reward. Fix: set reward_function (module:function, or a "
                                   f"list of them) or reward_model (a path).")
        reward_model = rewards[0] if len(rewards) == 1 else rewards
        prompts = inputs.get("prompts")
        if prompts is None:
            raise TrainConfigError(f"{path}: train: no prompts. Fix: set prompts to a .jsonl/.parquet path.")
        if isinstance(prompts, str) and not Path(prompts).is_file():
            raise TrainConfigError(f"{path}: train.prompts: {shorten(repr(prompts))} does not exist. Fix: give a "
                                   f"path relative to the run file or an absolute one.")
        # Read now, not in the trainer: a bad line or a missing column is one line, before anything starts.
        prompts = read_rows(prompts, run.train.prompt_column, run.train.columns)
        eval_prompts = inputs.get("eval_prompts")
        if eval_prompts is not None:
            eval_prompts = read_rows(eval_prompts, run.train.prompt_column, run.train.columns)
        if resume is True and not (output_dir or inputs.get("output_dir")):
            raise TrainConfigError("--resume without a directory resumes from the output directory, and none is "
                                   "set. Fix: pass --output-dir (or train.output_dir), or --resume DIR.")
    except (ResourceConfigError, TrainConfigError, FileNotFoundError, ValueError, ImportError) as error:
        print(f"dask-rl: {error}", file=sys.stderr)
        return 2
    from pipeline.checkpoint import CheckpointError
    from pipeline.models import ModelSourceError, create_tiny_model
    from pipeline.trainer import HybridTrainer

    out = Path(output_dir or inputs.get("output_dir") or tempfile.mkdtemp(prefix="dask-rl-run-"))
    out.mkdir(parents=True, exist_ok=True)
    actor_model = inputs.get("actor_model", "tiny")
    if actor_model in ("tiny", "tiny-chat"):  # the examples' local models (tiny-chat has a chat template)
        actor_model = str(create_tiny_model(out / actor_model, seed=run.train.seed, chat=actor_model == "tiny-chat"))
    train = {k: v for k, v in vars(run.train).items() if k != "algorithm"}
    stop = _StopOnSignal()
    try:
        trainer = HybridTrainer(actor_model, reward_model, run.resources, algorithm=run.train.algorithm,
                                prompts=prompts, eval_prompts=eval_prompts, critic_model=inputs.get("critic_model"),
                                reference_model=inputs.get("reference_model"), output_dir=str(out),
                                dashboard_address=dashboard_address, scheduler_address=scheduler_address,
                                resume=resume, host=host, security=security, **train)
    except (ModelSourceError, CheckpointError) as error:  # raised before any worker starts
        print(f"dask-rl: {error}", file=sys.stderr)
        return 2
    with stop.watching(trainer), trainer:
        history = [] if stop.signal else trainer.train(on_step=lambda r: _show_sample(r, sample_every))
    where = f"model in {out / 'actor'}, metrics in {out / 'metrics.jsonl'}"
    if trainer.outputs.last_checkpoint is not None:
        where += f", checkpoint in {trainer.outputs.last_checkpoint}"
    if stop.signal:
        print(f"dask-rl: stopped by {stop.signal.name} after step {trainer.first_step + len(history)}; {where}",
              flush=True)
        return 128 + stop.signal.value
    window = max(1, len(history) // 5)
    first = sum(r.reward_mean for r in history[:window]) / window
    last = sum(r.reward_mean for r in history[-window:]) / window
    print(f"dask-rl: mean reward of the first {window} steps {first:.3f}, of the last {window} steps {last:.3f}; "
          f"{where}")
    return 0


def _show_sample(record, every: int) -> None:
    if every and record.samples and (record.step + 1) % every == 0:
        sample = record.samples[0]
        print(f"dask-rl: step {record.step + 1} sample (reward {sample['reward']:.2f}): "
              f"{sample['prompt']!r} -> {sample['response']!r}", flush=True)


def _reward_function(spec, resolve):
    """A run file's reward: "module:function", or {function: "module:function", kwargs: {...}}
    whose keywords are bound to it (e.g. a format reward's pattern)."""
    import functools

    if not isinstance(spec, dict):
        return resolve(spec)
    from pipeline.config import TrainConfigError

    unknown = set(spec) - {"function", "kwargs"}
    kwargs = spec.get("kwargs", {})
    if unknown or "function" not in spec or not isinstance(kwargs, dict):
        raise TrainConfigError(f"train.reward_function: {spec!r}: write a reward as 'module:function' or "
                               f"{{function: 'module:function', kwargs: {{name: value}}}}.")
    return functools.partial(resolve(spec["function"]), **kwargs)


class _StopOnSignal:
    """The first SIGINT or SIGTERM asks the trainer to stop after the step in flight; a
    second SIGINT exits at once (the weight snapshots are removed first)."""

    def __init__(self):
        import signal

        self.signal = None
        self.trainer = None
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, number, frame) -> None:
        import contextlib
        import os
        import shutil
        import signal

        if self.signal is not None and number == signal.SIGINT:
            import psutil  # distributed's own dependency

            # The worker processes this run started go first: an update still in flight
            # would otherwise publish into the snapshot directory after it was removed.
            for child in psutil.Process().children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    child.kill()
            if self.trainer is not None:
                shutil.rmtree(self.trainer.fleet.snapshot_dir, ignore_errors=True)
            print("\ndask-rl: interrupted again; exiting now", file=sys.stderr, flush=True)
            os._exit(130)
        if self.signal is None:
            self.signal = signal.Signals(number)
            print(f"\ndask-rl: {self.signal.name}: stopping after the step in flight (Ctrl-C again to exit now)",
                  file=sys.stderr, flush=True)
            if self.trainer is not None:
                self.trainer.request_stop()

    def watching(self, trainer):
        import contextlib
        import signal

        self.trainer = trainer

        @contextlib.contextmanager
        def restoring():
            try:
                yield
            finally:
                for number, handler in self._previous.items():
                    signal.signal(number, handler)
        return restoring()


if __name__ == "__main__":
    sys.exit(main())

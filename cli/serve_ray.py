"""`hippo serve --ray [ADDRESS]`: the same app on Ray Serve, one pipeline and one batch engine per replica.

Each of `--replicas` Ray Serve replicas builds what `hippo serve` builds in its own process (a pipeline, a
`hippo.service.Service` loop and the FastAPI app: `hippo.cli.serve.build_app`), and Ray's HTTP proxy on
--host/--port spreads the requests over them. So every endpoint, error, stream and answer is the one
process's; `/metrics` and `/health` are per replica (the one the proxy picked). A replica admits up to
--max-batch + --max-queue requests at once, so past that its own queue answers 429 as one process does.

Every node must import the same hippo (`pip install 'hippo[serve-ray]'` there) and read the checkpoints and
the media directory at the same paths; relative paths are made absolute from this directory first.
SIGTERM or SIGINT shuts Serve down: each replica stops accepting and drains its requests in flight for up
to --drain seconds, then the command exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

from hippo.cli.batch_ray import absolute, check_ray_resources, connect, first_line
from hippo.errors import ConfigError, HippoError

EXTRA = "pip install 'hippo[serve-ray]'"
APP = "hippo"


def require_serve() -> tuple[Any, Any]:
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise ConfigError(f"--ray needs Ray Serve, which is not installed ({exc}); {EXTRA}") from None
    return ray, serve


class Replica:
    """One Ray Serve replica: `hippo serve`'s app on a pipeline of its own (built on the replica, from
    the command's options, when Serve asks for the app)."""

    def __init__(self, options: dict[str, Any]):
        self.options = options
        self.pipe = None

    def __serve_build_asgi_app__(self) -> Any:
        from hippo.cli.serve import build_app

        app, self.pipe, _ = build_app(argparse.Namespace(**self.options))
        return app


def replica_options(args: argparse.Namespace) -> dict[str, Any]:
    """The command's options as a replica rebuilds them: plain values, paths made absolute."""
    options = {k: v for k, v in vars(args).items() if not callable(v)}
    for key in ("target", "draft", "config", "media_dir"):
        if options.get(key) is not None:
            options[key] = absolute(options[key])
    options["ray"] = None  # a replica serves in its own process
    if not options.get("api_key") and os.environ.get("HIPPO_API_KEY"):  # a replica's node may lack it
        options["api_key"] = os.environ["HIPPO_API_KEY"]
    return options


def check_options(args: argparse.Namespace) -> None:
    if args.replicas < 1:
        raise ConfigError(f"--replicas must be >= 1, got {args.replicas}")
    check_ray_resources(args, "a replica")


def serve_on_ray(args: argparse.Namespace) -> int:
    from hippo.builder import PipelineBuilder
    from hippo.cli.serve import check_serve_options
    from hippo.cli.video_commands import pipeline_config, prepare, quiet_transformers
    from hippo.registry import lookup

    ray, serve = require_serve()
    check_options(args)
    # what `hippo serve` checks before it loads a model, here before any replica starts
    check_serve_options(args)
    cfg = pipeline_config(args)
    PipelineBuilder.from_config(cfg)
    with quiet_transformers(args.debug, False):
        prepare(args, cfg, lookup("schedulers", cfg.scheduler.name).needs_draft)
    name = args.served_model_name or Path(cfg.target).name
    # Serve kills an HTTP proxy not ready within 5 s, and `serve.start` then fails; on a busy machine
    # a new process can take longer to start. A Ray instance started here gives it a minute.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    started = connect(ray, args)
    if not args.debug:
        logging.getLogger("ray.serve").setLevel(logging.ERROR)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        deployment = serve.deployment(
            name=APP,
            num_replicas=args.replicas,
            ray_actor_options={"num_cpus": args.ray_num_cpus, "num_gpus": args.ray_num_gpus},
            max_ongoing_requests=args.max_batch + args.max_queue,
            graceful_shutdown_timeout_s=args.drain + 5,
        )(serve.ingress()(Replica))
        try:
            serve.run(deployment.bind(replica_options(args)), name=APP, route_prefix="/")
        except Exception as exc:
            raise HippoError(
                f"the Ray Serve replicas did not start ({first_line(exc)}); run `hippo serve` without "
                "--ray to see the error, or add --debug"
            ) from exc
        print(
            f"hippo serve: {name} on http://{args.host}:{args.port}/v1 ({args.replicas} Ray Serve replicas)",
            flush=True,
        )
        stop.wait()
        serve.shutdown()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if started:
            ray.shutdown()
    return 0

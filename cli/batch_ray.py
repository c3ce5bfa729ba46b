"""`hippo batch --ray [ADDRESS]`: the same records through `Pipeline.map` on a pool of Ray actors.

Ray Data's `map_batches` hands `--window` records at a time to an actor pool; each actor builds one
pipeline (`--ray-num-cpus` / `--ray-num-gpus` each) and answers its batch with `Pipeline.map`, so every
answer is exactly what the in-process run gives. The driver (the `hippo batch` process) reads IN and
writes OUT with the same resume rules; the rows in flight are the actors' current batches.

Every node must import the same hippo (`pip install 'hippo[ray]'` there) and read the checkpoints and
videos at the same paths (a shared file system); relative paths are made absolute from the driver's
current directory first. Ray is optional: without it `--ray` is a usage error naming the extra.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

import attrs

from hippo.builder import PipelineBuilder, PipelineConfig
from hippo.errors import ConfigError, HippoError

EXTRA = "pip install 'hippo[ray]'"


def require_ray() -> Any:
    try:
        import ray
        import ray.data  # noqa: F401 - the extra is ray[data]
    except ImportError as exc:
        raise ConfigError(f"--ray needs Ray Data, which is not installed ({exc}); {EXTRA}") from None
    return ray


def check_ray_resources(args: argparse.Namespace, unit: str) -> None:
    """--ray-num-cpus and --ray-num-gpus: numbers >= 0, not both 0 (each Ray `unit` needs some)."""
    for flag, value in (("--ray-num-cpus", args.ray_num_cpus), ("--ray-num-gpus", args.ray_num_gpus)):
        if not 0 <= value < math.inf:
            raise ConfigError(f"{flag} must be a number >= 0, got {value}")
    if args.ray_num_cpus == 0 and args.ray_num_gpus == 0:
        raise ConfigError(f"{unit} needs some resources: give --ray-num-cpus or --ray-num-gpus > 0")


def check_ray_options(args: argparse.Namespace) -> None:
    require_ray()
    check_ray_resources(args, "an actor")
    if args.ray_actors is not None and args.ray_actors < 1:
        raise ConfigError(f"--ray-actors must be >= 1, got {args.ray_actors}")


class BatchActor:
    """One pipeline on one Ray actor: `__call__` answers a batch of JSON records with `Pipeline.map`."""

    def __init__(self, config: PipelineConfig, map_kwargs: dict[str, Any]):
        from hippo.media.inputs import load_tokenizer

        self.pipe = PipelineBuilder.from_config(config).build()
        self.tokenizer = load_tokenizer(config.target)
        self.map_kwargs = map_kwargs

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[str]]:
        records = [json.loads(r) for r in batch["record"]]
        results = self.pipe.map(records, tokenizer=self.tokenizer, **self.map_kwargs)
        return {"result": [json.dumps(r.as_dict()) for r in results]}


def actor_count(ray: Any, args: argparse.Namespace) -> int:
    """--ray-actors, else as many actors as the cluster's CPUs and GPUs hold.

    A new local instance (a bare --ray) never grows, so too few resources for the actors asked for
    is a usage error there (Ray would wait for them forever); a running cluster may be autoscaling,
    so there it is only said, and Ray waits.
    """
    total = ray.cluster_resources()
    per = {"CPU": args.ray_num_cpus, "GPU": args.ray_num_gpus}
    room = min(int(total.get(k, 0) / v + 1e-9) for k, v in per.items() if v)
    want = args.ray_actors or max(1, room)
    if want > room:
        have = f"{total.get('CPU', 0):g} CPUs and {total.get('GPU', 0):g} GPUs"
        ask = f"{want} actor(s) of --ray-num-cpus {per['CPU']:g} --ray-num-gpus {per['GPU']:g}"
        if args.ray == "local":
            raise ConfigError(
                f"the local Ray instance has {have}, too few for {ask}; ask for less, or join a "
                "cluster with --ray ADDRESS"
            )
        print(f"hippo batch: the Ray cluster has {have} now, too few for {ask}; waiting", file=sys.stderr)
    return want


def first_line(exc: BaseException) -> str:
    lines = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip().splitlines()  # Ray colours its messages
    return (lines[0] if lines else type(exc).__name__)[:300]


def absolute(path: str | None) -> str | None:
    """`path` from this directory, as a worker in another directory (or node) must open it."""
    return None if path is None else os.path.abspath(os.path.expanduser(path))


def connect(ray: Any, args: argparse.Namespace) -> bool:
    """Connect to Ray as --ray says, unless this process is connected already; True when this call
    connected (the caller shuts Ray down). A failed connection is a usage error (ConfigError)."""
    if ray.is_initialized():
        return False
    address = args.ray  # "local" (a bare --ray): always a new instance, whatever runs already
    level = logging.INFO if args.debug else logging.ERROR
    try:
        ray.init(address=address, logging_level=level, log_to_driver=bool(args.debug))
    except Exception as exc:  # ConnectionError, RuntimeError, ValueError, AuthenticationError...
        where = "a new local Ray instance" if address == "local" else f"the Ray cluster at {address!r}"
        raise ConfigError(
            f"cannot start or reach {where} ({first_line(exc)}); check --ray ADDRESS, or start a "
            "cluster with `ray start --head`"
        ) from exc
    return True


@contextlib.contextmanager
def ray_session(args: argparse.Namespace) -> Iterator[int]:
    """Ray, connected for the job: a new local instance for a bare --ray (shut down afterwards), the
    running cluster for --ray auto (RAY_ADDRESS, else the one `ray start` started on this machine),
    or the cluster at --ray ADDRESS; one already connected in this process is used as it is. A failed
    connection is a usage error; a Ray failure during the job is a HippoError saying that a re-run
    resumes."""
    ray = require_ray()
    started = connect(ray, args)
    try:
        yield actor_count(ray, args)  # before OUT is touched
    except ray.exceptions.RayError as exc:
        raise HippoError(
            f"the Ray job failed ({first_line(exc)}); the answers so far are in OUT: run the same command "
            "again to resume"
        ) from exc
    finally:
        if started:
            ray.shutdown()


def run_on_ray(
    args: argparse.Namespace,
    config: PipelineConfig,
    records: list[dict[str, Any]],
    map_kwargs: dict[str, Any],
    actors: int,
) -> Iterator[dict[str, Any]]:
    """The result entries of `records`, answered on `actors` Ray actors (Ray connected by
    `ray_session`), as each actor's batch finishes."""
    if not records:
        return
    import ray
    from ray.data import ActorPoolStrategy, DataContext

    if not args.debug:  # Ray Data logs its plan and timings on the driver
        logging.getLogger("ray.data").setLevel(logging.ERROR)
    DataContext.get_current().enable_progress_bars = False  # hippo batch draws its own
    config = attrs.evolve(config, target=absolute(config.target), draft=absolute(config.draft))
    records = [{**r, "video": absolute(r["video"])} for r in records]
    ds = ray.data.from_items([{"record": json.dumps(r)} for r in records])
    ds = ds.map_batches(
        BatchActor,
        fn_constructor_kwargs={"config": config, "map_kwargs": map_kwargs},
        batch_size=map_kwargs["window"],
        compute=ActorPoolStrategy(size=actors),
        num_cpus=args.ray_num_cpus,
        num_gpus=args.ray_num_gpus,
    )
    for row in ds.iter_rows():
        yield json.loads(row["result"])

"""A GPU check of hippo in one command: greedy equality with the target's own `generate` for every
decoding path, then the speed of speculative against plain decoding, in a few minutes.

    python -m hippo.benchmarks.gpu_check                      # one CUDA GPU, at most ~7-8 minutes
    python -m hippo.benchmarks.gpu_check --out gpu-report     # also gpu-report/gpu_check.{json,txt}
    python -m hippo.benchmarks.gpu_check --device cpu --quick # a smoke test of the script itself
    python -m hippo.benchmarks.gpu_check --cases devices --no-timing  # the multi-GPU layout alone

The pair ("tiny but wide"): the stock `Qwen2_5_VLForConditionalGeneration` with random weights,
a target with a 2048-wide language model of 10 layers (about 0.45B parameters), so that a GPU
forward is not only launch overhead, and a draft made of the target's first layer (a layer-skip
self-draft: the embeddings, layer 0, the final norm, the LM head and the vision tower, copied). The
target's later layers write to the residual stream scaled by `--skip-scale`, which sets how often
the draft agrees with the target (0: always; the default 0.03: 84% of draft tokens accepted by serial
γ=4 at the default width in float32; 0.1: 24%).
The prompt is a synthetic video (8 frames of 224x224 px: 256 visual tokens) between a few text
tokens, built by the adapter's `synthetic_inputs`; no file is read and nothing is downloaded.

Equality (float32 and bfloat16; oracle: `target.generate(do_sample=False)`, never another hippo run):
- `serial`: vanilla speculative decoding, fixed γ;
- `hippo`: the parallel schedule on the `inline` executor with its thread overlap (on CUDA the
  draft's kernels go to their own stream);
- `process`: the parallel schedule with the draft in a spawned process (`hippo.plugins.process_executor`);
  a draft that fails there makes hippo finish with the target alone, which this check reports as a
  failure of the case (the output is still compared);
- `batch` and `batch-process`: `hippo` on a batch of two rows (the prompt twice), its draft drafting
  each row's next block beside the target on a thread (a CUDA stream of its own), or with the rows
  in the draft process (`ProcessBatchDraft`); each row must equal `generate`;
- `compiled`: serial decoding with the target on a compiled static-cache session (`hippo.static`,
  `PipelineBuilder.compile("target")`; on CUDA inductor with CUDA graphs, one graph per width);
- `devices`: the paper's multi-device layout. The target is saved and loaded again with a JSON device
  map (`target_device_map`) that splits its decoder layers over every GPU but the last (over the one
  GPU there is, on a single-GPU machine; every module on "cpu" with `--device cpu`), and the draft
  runs on the last GPU (`draft_device`), with `serial` and with `hippo` on the `process` executor; the
  oracle is the mapped target's own `generate`. Needs accelerate (`pip install accelerate`).
A verification forward scores γ+1 tokens at once where `generate` scores one, so their kernels
differ and so may the last bits of the logits. Where a case differs from `generate`, the check
reports the first differing position and the target's top-2 logit gap there (from `generate`'s
own logits): when generate's token leads the one taken by at most `TIE` of the largest |logit|
there (bfloat16: 2^-6, a few units of its rounding; float32: 1e-4) it is a near-tie, reported as
TIE and not a failure; anything else is a FAIL.

Timing (bfloat16 on CUDA): HF `generate`, hippo's `autoregressive` scheduler (eager, and on the
compiled target), `serial` and `hippo` with γ from the cost model, serial on the compiled target,
and the `auto` scheduler where one is registered. Each row: one warm-up run (excluded), then the
median of `--repeats` runs, each between `torch.cuda.synchronize()` calls; every run's output is
compared with `generate`'s too. Speedups are over HF `generate` and over the fastest
target-alone row of the run. The whole run keeps to `--budget` seconds (default 360): steps that
would start after it are skipped and named, and the summary is still printed; a step that started
in time may overrun it (a compiled one by a minute or two, compiling).

Exit status: 0 PASS, 1 FAIL, 2 when `--device cuda` was asked and there is no CUDA device.

It needs no installed entry points: when hippo's built-in plugins are not installed (a checkout on
PYTHONPATH), it registers them from the checkout's pyproject.toml for this process and its children.
Such a checkout needs the installed layout (hippo.X is the folder X/ for plugins, adapters, media,
cli and benchmarks), e.g. from the repository root:

    S=$(mktemp -d); mkdir $S/hippo; ln -s $PWD/hippo/* $S/hippo/
    for x in plugins adapters media cli benchmarks; do ln -s $PWD/$x $S/hippo/$x; done
    PYTHONPATH=$S python -m hippo.benchmarks.gpu_check
"""

from __future__ import annotations

import argparse
import atexit
import copy
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

CASES = ("serial", "hippo", "process", "batch", "batch-process", "compiled", "devices")
#: the schedules the `devices` case runs on the paper's layout (the target by a device map, the draft
#: on a GPU of its own)
DEVICE_CASES = ("serial", "process")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: a mismatch is a near-tie when generate's top logit beats the token taken by at most this share
#: of the largest |logit| at that position: 2-4 units of bfloat16 rounding (8 bits), and ~1000 units
#: of float32 rounding (summation orders differ between a 1-token and a (γ+1)-token forward)
TIE = {torch.float32: 1e-4, torch.bfloat16: 2**-6}
#: seconds a compiled step is given to start within the budget (its first graphs compile)
COMPILE_SECONDS = 90.0


# ---- plugins without an installed package ------------------------------------------------------


def _entry_points_from_pyproject(path: Path) -> list[tuple[str, str]]:
    """(name, value) of the `[project.entry-points.hippo]` table (a plain line reader: no tomllib
    needed on Python 3.10)."""
    out, inside = [], False
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.startswith("["):
            inside = line == "[project.entry-points.hippo]"
        elif inside and "=" in line:
            name, value = (s.strip().strip('"') for s in line.split("=", 1))
            out.append((name, value))
    return out


def ensure_builtins() -> str:
    """Make hippo's registry find its built-in plugins; returns how they were found.

    With hippo installed (`pip install -e .`) the entry points are there already. From a checkout on
    PYTHONPATH they are not: a `hippo` distribution's metadata (its entry points only, read from the
    checkout's pyproject.toml) is written to a temporary directory put on `sys.path`, which spawned
    children (the `process` executor's draft) inherit.
    """
    eps = metadata.entry_points(group="hippo")
    if any(ep.dist is not None and ep.dist.metadata["Name"] == "hippo" for ep in eps):
        return "installed entry points"
    import hippo.benchmarks

    pyproject = Path(hippo.benchmarks.__file__).resolve().parent.parent / "pyproject.toml"
    if not pyproject.is_file():
        raise SystemExit(
            f"hippo's built-in plugins are not installed and no pyproject.toml was found at {pyproject}; "
            "run `pip install --no-deps -e .` in the checkout"
        )
    entries = _entry_points_from_pyproject(pyproject)
    if not entries:
        raise SystemExit(f"{pyproject} has no [project.entry-points.hippo] table")
    root = Path(tempfile.mkdtemp(prefix="hippo-gpu-check-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    info = root / "hippo-0.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hippo\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text("[hippo]\n" + "".join(f"{n} = {v}\n" for n, v in entries))
    sys.path.append(str(root))
    from hippo.registry import plugin_manager

    plugin_manager.cache_clear()
    return f"registered from {pyproject} ({len(entries)} built-in plugins)"


# ---- the pair -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """The random pair's sizes: the target's language model; the draft is its first layers."""

    hidden: int = 2048  # residual width of both models
    layers: int = 10  # the target's decoder layers
    heads: int = 16  # query heads (head_dim = hidden / heads)
    kv_heads: int = 4  # key/value heads (grouped-query attention)
    ffn: int = 5632  # MLP width
    draft_layers: int = 1  # the draft: the target's first layers, the same embeddings and head
    frames: int = 8  # video frames of the synthetic clip
    pixels: int = 224  # frame side; a multiple of 28 (patch 14 x merge 2)
    new_tokens: int = 65  # 1 + 16 rounds of γ=4 fully accepted: few distinct verification widths


FULL = Sizes()
QUICK = Sizes(hidden=64, layers=3, heads=2, kv_heads=1, ffn=128, frames=2, pixels=56, new_tokens=13)


@dataclass
class Pair:
    target: Any
    draft: Any
    inputs: dict  # on the CPU: the pipelines move what they need
    device_inputs: dict  # on the device, for HF generate
    dtype: torch.dtype


def _config(sizes: Sizes, layers: int):
    from hippo.benchmarks.models import pair_config

    return pair_config(
        "target",
        hidden=sizes.hidden,
        layers=layers,
        heads=sizes.heads,
        kv_heads=sizes.kv_heads,
        ffn=sizes.ffn,
    )


@torch.no_grad()
def build_models(sizes: Sizes, device: str, skip_scale: float, seed: int) -> tuple[Any, Any]:
    """(target, draft) in float32 on `device`: the draft is the target's first `draft_layers` layers."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from hippo.cli.pair.tokens import set_generation_defaults

    torch.manual_seed(seed)
    with torch.device(device):  # initialised on the device: seconds, not a minute of CPU init
        target = Qwen2_5_VLForConditionalGeneration(_config(sizes, sizes.layers)).to(device).eval()
        for layer in target.model.language_model.layers[sizes.draft_layers :]:
            layer.self_attn.o_proj.weight.mul_(skip_scale)  # what the layer writes to the residual
            layer.mlp.down_proj.weight.mul_(skip_scale)
        draft = Qwen2_5_VLForConditionalGeneration(_config(sizes, sizes.draft_layers)).to(device).eval()
    result = draft.load_state_dict(target.state_dict(), strict=False)
    if result.missing_keys:
        raise RuntimeError(f"the draft's weights were not all copied from the target: {result.missing_keys}")
    for m in (target, draft):
        set_generation_defaults(m)
    return target, draft


def make_pair(target32: Any, draft32: Any, sizes: Sizes, dtype: torch.dtype, seed: int) -> Pair:
    from hippo.registry import lookup

    if dtype == torch.float32:
        target, draft = target32, draft32
    else:
        target, draft = copy.deepcopy(target32).to(dtype), copy.deepcopy(draft32).to(dtype)
    g = torch.Generator().manual_seed(seed)
    video = torch.rand(sizes.frames, sizes.pixels, sizes.pixels, 3, generator=g)  # [T, H, W, 3]
    qwen = lookup("adapters", "qwen2_5_vl")
    inputs = qwen.synthetic_inputs(target, video, [20, 21, 22], [30, 31])  # ids past the special tokens
    device = next(target.parameters()).device
    on_device = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}
    return Pair(target, draft, inputs, on_device, dtype)


# ---- runs ---------------------------------------------------------------------------------------


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def gen_kwargs(n: int) -> dict:
    return {"max_new_tokens": n, "min_new_tokens": n, "do_sample": False}


def reference(pair: Pair, n: int) -> Any:
    """The oracle: the target's own greedy `generate`, with its logits at every step."""
    with torch.inference_mode():
        return pair.target.generate(
            **pair.device_inputs, **gen_kwargs(n), output_logits=True, return_dict_in_generate=True
        )


def _selector(builder: Any, args: argparse.Namespace) -> None:
    """The draft sees every visual token, or a uniform `--keep-ratio` share of them."""
    if args.keep_ratio is None:
        builder.selector("full")
    else:
        builder.selector("uniform", keep_ratio=args.keep_ratio)


def case_pipeline(pair: Pair, case: str, args: argparse.Namespace):
    """The pipeline of one equality case (γ fixed, so a compiled target sees few widths)."""
    import hippo

    b = hippo.PipelineBuilder().target(pair.target).draft(pair.draft)
    _selector(b, args)
    gamma = args.gamma
    if case == "serial":
        b.scheduler("serial", gamma=gamma)
    elif case == "hippo":
        b.scheduler("hippo", gamma=gamma, executor="inline", executor_options={"overlap": "thread"})
    elif case in ("process", "batch-process"):
        b.scheduler("hippo", gamma=gamma, executor="process", executor_options={"timeout": 120.0})
    elif case == "batch":
        b.scheduler("hippo", gamma=gamma, executor="inline", executor_options={"overlap": "thread"})
    elif case == "compiled":
        b.scheduler("serial", gamma=gamma).compile("target", mode=args.compile_mode)
    else:
        raise ValueError(f"unknown case {case!r}")
    return b.build()


def device_layout(device: str, layers: int) -> tuple[dict[str, str], str]:
    """({module: device} for the target, the draft's device): the paper's layout on this machine.

    With n >= 2 GPUs the target's decoder layers are split evenly over cuda:0 .. cuda:n-2 (the vision
    tower and the embeddings on the first, the final norm and the head on the last of them) and the
    draft gets cuda:n-1; with one GPU both share cuda:0; with `device` "cpu" every module is on "cpu"
    (the smoke test of this path)."""
    lm = "model.language_model"
    if device == "cpu":
        return {"model.visual": "cpu", lm: "cpu", "lm_head": "cpu"}, "cpu"
    if not torch.cuda.is_available():
        raise RuntimeError("the devices case needs a CUDA device (or --device cpu for its smoke test)")
    n = torch.cuda.device_count()
    gpus = [f"cuda:{i}" for i in range(max(1, n - 1))]
    split = {f"{lm}.layers.{i}": gpus[i * len(gpus) // layers] for i in range(layers)}
    first, last = gpus[0], gpus[-1]
    layout = {"model.visual": first, f"{lm}.embed_tokens": first, **split}
    layout.update({f"{lm}.norm": last, f"{lm}.rotary_emb": first, "lm_head": last})
    return layout, f"cuda:{n - 1}"


def check_devices(pair: Pair, args: argparse.Namespace) -> list[dict]:
    """The `devices` case (see the module doc): one result per schedule in `DEVICE_CASES`."""
    import hippo

    n, L = args.new_tokens, int(pair.inputs["input_ids"].shape[1])
    layout, draft_device = device_layout(args.device, len(pair.target.model.language_model.layers))
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="hippo-devices-") as tmp:
        pair.target.save_pretrained(Path(tmp) / "target")
        (Path(tmp) / "map.json").write_text(json.dumps(layout))
        config = {"target": str(Path(tmp) / "target"), "target_device_map": str(Path(tmp) / "map.json")}
        config.update(draft_device=draft_device, dtype=str(pair.dtype).removeprefix("torch."))
        mapped = None
        for case in DEVICE_CASES:
            t0, pipe = time.perf_counter(), None
            try:
                scheduler = {"name": "serial", "gamma": args.gamma}
                if case == "process":
                    scheduler = {"name": "hippo", "gamma": args.gamma, "executor": "process"}
                b = hippo.PipelineBuilder.from_config({**config, "scheduler": scheduler}).draft(
                    copy.deepcopy(pair.draft)
                )
                _selector(b, args)
                pipe = b.build()
                placed = pipe.target_adapter.devices
                if mapped is None:  # the oracle: the mapped target's own greedy generate
                    mapped = pipe.target
                    on = {
                        k: v.to(pipe.target_adapter.device) if torch.is_tensor(v) else v
                        for k, v in pair.inputs.items()
                    }
                    with torch.inference_mode():
                        ref = mapped.generate(
                            **on, **gen_kwargs(n), output_logits=True, return_dict_in_generate=True
                        )
                out = pipe.generate(pair.inputs, **gen_kwargs(n))
                _sync()
                result = {**compare(out.sequences, ref, L, pair.dtype), **_stats(out)}
                result["target_devices"] = [str(d) for d in placed]
                result["draft_device"] = str(pipe.draft_adapter.device)
                if out.stats.fallback:
                    result["why"] = (
                        f"the draft failed and the target finished alone: {'; '.join(out.stats.notes)}"
                    )
                    result["status"] = "fallback"
            except Exception as exc:  # reported as a failed case, never hidden
                result = {"status": "error", "why": f"{type(exc).__name__}: {exc}"}
            finally:
                if pipe is not None:
                    pipe.close()
            result.update(case=f"devices/{case}", seconds=time.perf_counter() - t0)
            results.append(result)
    return results


def compare(sequences: torch.Tensor, ref: Any, prompt_len: int, dtype: torch.dtype) -> dict:
    """'equal', or where the run first differs from `generate` and whether that is a near-tie."""
    got = sequences[0, prompt_len:].cpu()
    want = ref.sequences[0, prompt_len:].cpu()
    if got.shape == want.shape and torch.equal(got, want):
        return {"status": "equal"}
    n = min(got.shape[0], want.shape[0])
    diff = (got[:n] != want[:n]).nonzero()
    if diff.numel() == 0:
        return {"status": "differ", "why": f"length {got.shape[0]} against generate's {want.shape[0]}"}
    i = int(diff[0])
    logits = ref.logits[i][0].float().cpu()  # [V]: generate's at the first differing step
    top = logits.topk(2)
    scale = float(logits.abs().max()) or 1.0
    lead = float(logits[int(want[i])] - logits[int(got[i])])  # generate's token over the one taken
    tie = lead <= TIE[dtype] * scale
    return {
        "status": "tie" if tie else "differ",
        "position": i,
        "generate_token": int(want[i]),
        "token": int(got[i]),
        "top2_gap": float(top.values[0] - top.values[1]),
        "lead_over_taken": lead,
        "relative_lead": lead / scale,
        "tie_threshold": TIE[dtype],
    }


def _describe(c: dict) -> str:
    if c["status"] == "equal":
        return "equal"
    if "position" not in c:
        return f"DIFFERS: {c['why']}"
    word = "near-tie" if c["status"] == "tie" else "NOT a near-tie"
    return (
        f"{'TIE' if c['status'] == 'tie' else 'DIFFERS'} at new token {c['position']}: generate {c['generate_token']}, "
        f"hippo {c['token']}; generate's top-2 gap {c['top2_gap']:.3g}, its lead over hippo's token "
        f"{c['lead_over_taken']:.3g} ({c['relative_lead']:.2g} of the largest |logit|; {word})"
    )


def _stats(out: Any) -> dict:
    s = out.stats
    return {
        "mat": s.mat,
        "acceptance_rate": s.acceptance_rate,
        "fallback": s.fallback,
        "notes": list(s.notes),
        "seconds_compile": s.seconds_compile,
        "seconds_total": s.seconds_total,
        "seconds_target_decode": s.seconds_target_decode,
        "seconds_draft_decode": s.seconds_draft_decode,
        "drafted_per_round": list(s.drafted_per_round),
        "accepted_per_round": list(s.accepted_per_round),
    }


# ---- the report ---------------------------------------------------------------------------------


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    start: float = field(default_factory=time.monotonic)

    def log(self, line: str = "") -> None:
        self.lines.append(line)
        print(line, flush=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.start


def environment(device: str, plugins: str) -> dict:
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device,
        "plugins": plugins,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
        env["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    return env


# ---- equality -----------------------------------------------------------------------------------


def check_case(pair: Pair, ref: Any, case: str, args: argparse.Namespace) -> dict:
    n, L = args.new_tokens, int(pair.inputs["input_ids"].shape[1])
    pipe = None
    t0 = time.perf_counter()
    try:
        pipe = case_pipeline(pair, case, args)
        if case.startswith("batch"):  # two rows decoded together: the first that differs is reported
            outs = pipe.generate_batch([pair.inputs, pair.inputs], **gen_kwargs(n))
            _sync()
            found = [compare(o.sequences, ref, L, pair.dtype) for o in outs]
            out = next((o for o, c in zip(outs, found) if c["status"] != "equal"), outs[0])
        else:
            out = pipe.generate(pair.inputs, **gen_kwargs(n))
            _sync()
        result = {**compare(out.sequences, ref, L, pair.dtype), **_stats(out)}
        if out.stats.fallback:  # the output is the target's alone: the path under test did not run
            result["why"] = f"the draft failed and the target finished alone: {'; '.join(out.stats.notes)}"
            result["status"] = "fallback"
    except Exception as exc:  # reported as a failed case, never hidden
        result = {"status": "error", "why": f"{type(exc).__name__}: {exc}"}
    finally:
        if pipe is not None:
            pipe.close()
    result["seconds"] = time.perf_counter() - t0
    return result


# ---- timing -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    name: str
    hf: bool = False
    scheduler: str = "autoregressive"
    options: dict = field(default_factory=dict)
    compiled: bool = False
    compile_draft: bool = False  # compile the draft's session too
    baseline: bool = False  # the target alone: speedups are also given over the fastest of these


def timing_rows(args: argparse.Namespace, schedulers: set[str]) -> list[Row]:
    rows = [
        Row("HF generate (target alone)", hf=True, baseline=True),
        Row("hippo autoregressive", baseline=True),
        Row("serial, γ auto", scheduler="serial", options={"gamma": "auto"}),
        Row("hippo, γ auto (executor auto)", scheduler="hippo", options={"gamma": "auto"}),
    ]
    if "auto" in schedulers:  # the planner, where this hippo has one
        rows.append(Row("auto (planner)", scheduler="auto"))
    if "compiled" in args.cases:
        rows += [
            Row("hippo autoregressive, compiled target", compiled=True, baseline=True),
            Row(
                f"serial, γ={args.gamma}, compiled target",
                scheduler="serial",
                options={"gamma": args.gamma},
                compiled=True,
            ),
            Row(
                f"serial, γ={args.gamma}, compiled target and draft",
                scheduler="serial",
                options={"gamma": args.gamma},
                compiled=True,
                compile_draft=True,
            ),
        ]
    return rows


def row_call(pair: Pair, row: Row, args: argparse.Namespace):
    """(call, pipeline or None): call() runs the row once and returns (sequences, stats dict)."""
    import hippo

    gen = gen_kwargs(args.new_tokens)
    if row.hf:

        def hf():
            with torch.inference_mode():
                return pair.target.generate(**pair.device_inputs, **gen), {}

        return hf, None
    b = hippo.PipelineBuilder().target(pair.target).draft(pair.draft)
    _selector(b, args)
    b.scheduler(row.scheduler, **row.options)
    if row.compiled:
        b.compile("target", *(("draft",) if row.compile_draft else ()), mode=args.compile_mode)
    pipe = b.build()

    def run():
        out = pipe.generate(pair.inputs, **gen)
        return out.sequences, _stats(out)

    return run, pipe


def time_row(pair: Pair, ref: Any, row: Row, args: argparse.Namespace) -> dict:
    L = int(pair.inputs["input_ids"].shape[1])
    call, pipe = row_call(pair, row, args)
    try:
        _sync()
        t0 = time.perf_counter()
        seq, stats = call()  # warm-up: calibrations, CUDA graphs, a draft process; not timed
        _sync()
        warmup = time.perf_counter() - t0
        checks = [compare(seq, ref, L, pair.dtype)]
        times, recompiling = [], 0.0
        for _ in range(args.repeats):
            _sync()
            t0 = time.perf_counter()
            seq, stats = call()
            _sync()
            times.append(time.perf_counter() - t0)
            checks.append(compare(seq, ref, L, pair.dtype))
            recompiling += stats.get("seconds_compile", 0.0)
    finally:
        if pipe is not None:
            pipe.close()
    worst = next((c for c in checks if c["status"] == "differ"), None) or next(
        (c for c in checks if c["status"] == "tie"), checks[0]
    )
    seconds = statistics.median(times)
    return {
        "name": row.name,
        "baseline": row.baseline,
        "seconds": seconds,
        "times": times,
        "warmup_seconds": warmup,
        "compile_seconds_in_timed_runs": recompiling,  # > 0: a timed run compiled a graph (shapes changed)
        "tokens_per_second": args.new_tokens / seconds,
        "output": worst,
        "mat": stats.get("mat"),
        "acceptance_rate": stats.get("acceptance_rate"),
        "fallback": stats.get("fallback", False),
        "stats": {k: stats.get(k) for k in ("seconds_target_decode", "seconds_draft_decode")},
        "drafted_per_round": (stats.get("drafted_per_round") or [])[:24],
        "accepted_per_round": (stats.get("accepted_per_round") or [])[:24],
    }


def costs(pair: Pair, args: argparse.Namespace) -> dict:
    """Per-forward seconds of the target (1 token, γ+1 tokens) and of the draft (`regime.measure_costs`)."""
    from hippo.benchmarks.regime import measure_costs

    c = measure_costs(
        pair.target,
        pair.draft,
        pair.inputs,
        args.gamma,
        args.keep_ratio if args.keep_ratio is not None else 1.0,
        threads=torch.get_num_threads(),
        repeats=5,
    )
    return {
        "t_decode_ms": 1e3 * c["t_decode"],
        "t_verify_ms": 1e3 * c["t_verify"],
        "t_draft_ms": 1e3 * c["t_draft_full"],
        "verify_over_decode": c["t_verify"] / c["t_decode"],
        "draft_over_target": c["t_draft_full"] / c["t_decode"],
        "target_params": c["target_params"],
        "draft_params": c["draft_params"],
    }


def table(rows: list[dict]) -> list[str]:
    base = next((r["seconds"] for r in rows if r["name"].startswith("HF generate")), None)
    fastest = min((r["seconds"] for r in rows if r["baseline"]), default=None)
    out = [
        f"{'row':<40} {'tok/s':>8} {'s/run':>8} {'x HF':>6} {'x best AR':>9} {'MAT':>5} {'accept':>6}  output"
    ]
    for r in rows:
        mat = f"{r['mat']:.2f}" if r.get("mat") is not None else "-"
        acc = f"{r['acceptance_rate']:.2f}" if r.get("acceptance_rate") is not None and r["mat"] else "-"
        x_hf = f"{base / r['seconds']:.2f}" if base else "-"
        x_ar = f"{fastest / r['seconds']:.2f}" if fastest else "-"
        status = r["output"]["status"] + (" (fallback)" if r.get("fallback") else "")
        out.append(
            f"{r['name']:<40} {r['tokens_per_second']:>8.1f} {r['seconds']:>8.3f} {x_hf:>6} {x_ar:>9} "
            f"{mat:>5} {acc:>6}  {status}"
        )
    return out


# ---- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m hippo.benchmarks.gpu_check",
        description="Greedy equality of hippo's decoding paths with the target's own generate, in float32 "
        "and bfloat16, and the speed of speculative against plain decoding, on one GPU (exit 0 PASS, "
        "1 FAIL, 2 no CUDA device).",
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="default: cuda")
    p.add_argument(
        "--quick", action="store_true", help="tiny sizes, one timed repeat: a smoke test of the script (CPU)"
    )
    p.add_argument("--out", type=Path, help="write gpu_check.json and gpu_check.txt to this directory")
    p.add_argument(
        "--budget",
        type=float,
        default=360.0,
        help="seconds for the whole run (default 360); steps that would start later are skipped and "
        "named (a step started in time may overrun it: a compiled one by a minute or two)",
    )
    p.add_argument(
        "--cases",
        default=",".join(CASES),
        help=f"equality cases, comma-separated (default: {','.join(CASES)})",
    )
    p.add_argument("--dtypes", default="float32,bfloat16", help="default: float32,bfloat16")
    p.add_argument("--timing-dtype", choices=tuple(DTYPES), help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--no-timing", action="store_true", help="equality checks only")
    p.add_argument("--repeats", type=int, help="timed runs per row (default 5; 1 with --quick)")
    p.add_argument("--new-tokens", type=int, help=f"tokens per run (default {FULL.new_tokens})")
    p.add_argument("--gamma", type=int, default=4, help="γ of the equality cases (default 4)")
    p.add_argument(
        "--skip-scale",
        type=float,
        default=0.03,
        help="scale of what the target's layers past the draft's write (0: the draft always agrees; "
        "default 0.03)",
    )
    p.add_argument(
        "--keep-ratio",
        type=float,
        help="share of visual tokens the draft sees (uniform selector); default: all of them",
    )
    p.add_argument(
        "--compile-mode",
        choices=("inductor", "eager"),
        default="inductor",
        help="the compiled case's mode (eager: the static cache without torch.compile; default inductor)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.sizes = QUICK if args.quick else FULL
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = sorted(set(args.cases) - set(CASES))
    if bad:
        p.error(f"unknown cases {bad}; choose among {', '.join(CASES)}")
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = sorted(set(args.dtypes) - set(DTYPES))
    if bad:
        p.error(f"unknown dtypes {bad}; choose among {', '.join(DTYPES)}")
    args.repeats = args.repeats or (1 if args.quick else 5)
    args.new_tokens = args.new_tokens or args.sizes.new_tokens
    args.timing_dtype = args.timing_dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: --device cuda was asked but torch sees no CUDA device "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
            "run it on a machine with a GPU, or use --device cpu --quick for a smoke test",
            file=sys.stderr,
        )
        return 2
    rep = Report()
    try:
        return run(args, rep)
    except Exception as exc:  # a crash still ends with the summary line (and the traceback above it)
        import traceback

        traceback.print_exc()
        rep.data["error"] = f"{type(exc).__name__}: {exc}"
        finish(rep, args, "FAIL", f"crashed: {type(exc).__name__}: {exc}")
        return 1


def run(args: argparse.Namespace, rep: Report) -> int:
    plugins = ensure_builtins()
    from hippo.benchmarks.models import n_params
    from hippo.registry import registry

    rep.data["environment"] = environment(args.device, plugins)
    rep.data["arguments"] = {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "sizes"
    }
    rep.data["sizes"] = asdict(args.sizes)
    rep.log(f"gpu_check: {json.dumps(rep.data['environment'])}")

    t0 = time.perf_counter()
    target32, draft32 = build_models(args.sizes, args.device, args.skip_scale, args.seed)
    rep.log(
        f"pair: target {n_params(target32) / 1e6:.1f}M parameters ({args.sizes.layers} layers x "
        f"{args.sizes.hidden}), draft {n_params(draft32) / 1e6:.1f}M (its first {args.sizes.draft_layers} "
        f"layer(s), later layers' writes x {args.skip_scale}); built in {time.perf_counter() - t0:.1f}s"
    )
    pairs: dict[str, Pair] = {}
    refs: dict[str, Any] = {}
    skipped: list[str] = []
    equality: list[dict] = []

    def have_time(what: str, need: float = 0.0) -> bool:
        if rep.elapsed() + need <= args.budget:
            return True
        skipped.append(what)
        rep.log(f"  skipped (time budget {args.budget:.0f}s, {rep.elapsed():.0f}s used): {what}")
        return False

    for name in dict.fromkeys([*args.dtypes, *([] if args.no_timing else [args.timing_dtype])]):
        pairs[name] = make_pair(target32, draft32, args.sizes, DTYPES[name], args.seed)
    L = int(next(iter(pairs.values())).inputs["input_ids"].shape[1])
    rep.log(
        f"prompt: {L} tokens ({args.sizes.frames} frames of {args.sizes.pixels}px), {args.new_tokens} new tokens"
    )

    rep.log("")
    rep.log(f"equality with target.generate (greedy, γ={args.gamma}):")
    # the eager cases first (seconds), then the compiled ones (compiling takes minutes), the timing
    # dtype's first: what the budget cuts is the last compiled case, never an eager one
    order = [(c, d) for d in args.dtypes for c in args.cases if c not in ("compiled", "devices")]
    order += [("devices", d) for d in args.dtypes if "devices" in args.cases]
    if "compiled" in args.cases:
        order += [("compiled", d) for d in sorted(args.dtypes, key=lambda d: d != args.timing_dtype)]
    for case, name in order:
        pair = pairs[name]
        if name not in refs:
            if not have_time(f"generate reference, {name}"):
                continue
            refs[name] = reference(pair, args.new_tokens)
        need = COMPILE_SECONDS if case == "compiled" and args.compile_mode == "inductor" else 0.0
        if not have_time(f"{case}, {name}", need):
            continue
        for r in (
            check_devices(pair, args) if case == "devices" else [check_case(pair, refs[name], case, args)]
        ):
            r.setdefault("case", case)
            r["dtype"] = name
            equality.append(r)
            _log_case(rep, r)
    rep.data["equality"] = equality

    timing: list[dict] = []
    if not args.no_timing:
        name = args.timing_dtype
        pair = pairs[name]
        rep.log("")
        rep.log(f"timing ({name}, {args.new_tokens} new tokens, median of {args.repeats} after a warm-up):")
        if name not in refs and have_time(f"generate reference, {name}"):
            refs[name] = reference(pair, args.new_tokens)
        if name in refs and have_time("per-forward costs"):
            try:
                c = costs(pair, args)
                rep.data["costs"] = c
                rep.log(
                    f"  per forward: target 1 token {c['t_decode_ms']:.2f} ms, {args.gamma + 1} tokens "
                    f"{c['t_verify_ms']:.2f} ms (x{c['verify_over_decode']:.2f}); draft 1 token "
                    f"{c['t_draft_ms']:.2f} ms ({c['draft_over_target']:.2f} of the target's)"
                )
            except Exception as exc:
                rep.log(f"  per-forward costs: ERROR {type(exc).__name__}: {exc}")
        for row in timing_rows(args, set(registry("schedulers"))) if name in refs else []:
            need = COMPILE_SECONDS if row.compiled and args.compile_mode == "inductor" else 0.0
            if not have_time(f"timing row {row.name!r}", need):
                continue
            try:
                r = time_row(pair, refs[name], row, args)
            except Exception as exc:
                r = {"name": row.name, "error": f"{type(exc).__name__}: {exc}"}
                rep.log(f"  {row.name}: ERROR {r['error']}")
            else:
                again = r["compile_seconds_in_timed_runs"]
                rep.log(
                    f"  {row.name}: {r['tokens_per_second']:.1f} tok/s (warm-up {r['warmup_seconds']:.1f}s"
                    + (f"; the timed runs compiled for {again:.1f}s" if again else "")
                    + f"), output {_describe(r['output'])}"
                )
            timing.append(r)
        ok_rows = [r for r in timing if "error" not in r]
        if ok_rows:
            rep.log("")
            for line in table(ok_rows):
                rep.log(line)
    rep.data["timing"] = timing
    rep.data["skipped"] = skipped

    verdict, summary = summarise(equality, timing, skipped, timed=not args.no_timing)
    finish(rep, args, verdict, summary)
    return 0 if verdict == "PASS" else 1


def _log_case(rep: Report, r: dict) -> None:
    """One equality case's line."""
    extra = ""
    if "mat" in r:
        extra = f" (MAT {r['mat']:.2f}, {r['seconds']:.1f}s"
        extra += f", compiling {r['seconds_compile']:.1f}s)" if r.get("seconds_compile") else ")"
    if "target_devices" in r:
        extra += f" [target on {', '.join(r['target_devices'])}; draft on {r['draft_device']}]"
    text = r["why"] if r["status"] in ("error", "fallback") else _describe(r)
    if r["status"] == "fallback":
        text = f"FALLBACK ({_describe(r)}): {text}"
    elif r["status"] == "error":
        text = f"ERROR: {text}"
    rep.log(f"  {r['case']:<13} {r['dtype']:<9} {text}{extra}")


def summarise(
    equality: list[dict], timing: list[dict], skipped: list[str], *, timed: bool
) -> tuple[str, str]:
    """('PASS' | 'FAIL', one line): a case fails when it differs from generate other than at a near-tie,
    errs, or fell back to the target alone; a timing row fails when it errs or differs."""
    failed = [
        f"{r['case']}/{r['dtype']}: {r['status']}" for r in equality if r["status"] not in ("equal", "tie")
    ]
    failed += [
        f"timing {r['name']}: {r.get('error') or r['output']['status']}"
        for r in timing
        if "error" in r or r["output"]["status"] == "differ"
    ]
    if timed and not any("error" not in r for r in timing):
        failed.append("no timing row ran")
    ties = [f"{r['case']}/{r['dtype']}" for r in equality if r["status"] == "tie"]
    ties += [f"timing {r['name']}" for r in timing if "error" not in r and r["output"]["status"] == "tie"]
    equal = sum(r["status"] == "equal" for r in equality)
    parts = [f"{equal}/{len(equality)} equality cases equal to generate"]
    if ties:
        parts.append(f"near-ties (bf16/fp32 rounding, not failures): {', '.join(ties)}")
    if failed:
        parts.append(f"failed: {'; '.join(failed)}")
    if skipped:
        parts.append(f"skipped for time: {', '.join(skipped)}")
    return ("FAIL" if failed else "PASS"), "; ".join(parts)


def finish(rep: Report, args: argparse.Namespace, verdict: str, summary: str) -> None:
    """The summary line, and the report files under `--out`."""
    rep.data["verdict"] = verdict
    rep.data["elapsed_seconds"] = rep.elapsed()
    rep.log("")
    rep.log(f"GPU CHECK {verdict} ({args.device}): {summary}; {rep.elapsed():.0f}s")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.json").write_text(json.dumps(rep.data, indent=2, default=str) + "\n")
        (args.out / "gpu_check.txt").write_text("\n".join(rep.lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())

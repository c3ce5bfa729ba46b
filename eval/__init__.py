"""hippo on lmms-eval: the `hippo` model, `hippo eval`, and the bundled offline task `hippo_narrate`.

- `hippo.eval.model.Hippo`: lmms-eval's model interface (`lmms_eval.api.model.lmms`) on a hippo
  pipeline. lmms-eval finds it through its `lmms_eval.models` entry-point group (`manifest`), so
  `python -m lmms_eval --model hippo --model_args target=...,draft=...` works once `hippo[eval]` is
  installed;
- `hippo.eval.command`: `hippo eval`, which registers the bundled tasks, hands every other argument
  to lmms-eval, and with `--baseline` runs the target alone too and compares;
- `hippo.eval.narrate` and `tasks/hippo_narrate/`: the narration pair's held-out clips as a task.

Only `manifest` is imported by lmms-eval at start-up; it imports nothing heavy.
"""

from __future__ import annotations

from pathlib import Path

#: the bundled tasks' folder: lmms-eval's `--include_path` (`hippo eval` passes it itself)
TASKS = Path(__file__).parent / "tasks"
MODEL = "hippo"
MODEL_CLASS = "hippo.eval.model.Hippo"


def manifest():
    """The `lmms_eval.models` entry point: the `hippo` model's manifest for lmms-eval's registry."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest(model_id=MODEL, simple_class_path=MODEL_CLASS)

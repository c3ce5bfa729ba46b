"""hippo: holistic-aware parallel speculative decoding for video-LLMs, lossless by construction.

Public API: `PipelineBuilder`, `Pipeline`, `PipelineConfig`, `plugin_manager`, `hookimpl`, and the
interfaces a plugin implements (`Scorer`, `Selector`, `Drafter`, `Verifier`, `Scheduler` and its
`GammaPolicy`, `Adapter`).
`hippo.testing` (with `pip install 'hippo[testing]'`) proves a pipeline or a plugin part lossless.
"""

from hippo import errors
from hippo.builder import PartSpec, PipelineBuilder, PipelineConfig
from hippo.hookspecs import hookimpl
from hippo.interfaces import (
    Adapter,
    Drafter,
    Encoded,
    GammaPolicy,
    ModelSession,
    RoundInfo,
    Scheduler,
    Scorer,
    ScoringContext,
    Selector,
    Verifier,
)
from hippo.pipeline import Pipeline
from hippo.proposal import DraftProposal, Verdict
from hippo.registry import plugin_manager
from hippo.types import GenerateOutput, Stats, VisualTokens

__version__ = "0.1.0"

"""Token policy: how logits become tokens, exactly as transformers' `generate` does it.

The generation config is resolved and the logits processors are built by the *target's* own
GenerationMixin, so temperature, top-k, top-p, repetition penalty, min-new-tokens... apply to p and q
precisely as `target.generate(...)` would apply them. Speculative decoding evaluates several
positions at once, so each row is processed with the prefix it would have had in `generate`.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList

from hippo.errors import ConfigError, ModelError, UnsupportedError

_OURS = ("seed", "generator", "streamer")


def resolve_generation_config(
    model: Any, generation_config: GenerationConfig | None, kwargs: dict[str, Any]
) -> GenerationConfig:
    """Merge user kwargs > `generation_config` > `model.generation_config` > transformers' defaults."""
    try:
        gc, unused = model._prepare_generation_config(generation_config, **kwargs)
    except ValueError as exc:
        raise ConfigError(f"bad generation settings: {exc}") from exc
    unused = {k: v for k, v in unused.items() if v is not None}
    if unused:
        raise ConfigError(
            f"unknown generation option(s): {', '.join(sorted(unused))}; hippo takes GenerationConfig "
            f"fields plus {', '.join(_OURS)}"
        )
    for field, ok in (("num_beams", 1), ("num_return_sequences", 1)):
        if (getattr(gc, field, 1) or 1) != ok:
            raise UnsupportedError(
                f"{field}={getattr(gc, field)} is not supported; hippo decodes one sequence (use 1)"
            )
    for field in ("stop_strings", "prompt_lookup_num_tokens", "assistant_early_exit", "watermarking_config"):
        if getattr(gc, field, None):
            raise UnsupportedError(f"generation option {field} is not supported by hippo; remove it")
    if gc.do_sample and gc.temperature is not None and gc.temperature <= 0:
        raise ConfigError(f"temperature must be > 0 when sampling, got {gc.temperature}")
    refuse_unproven(gc)
    return gc


#: Options whose effect hippo cannot reproduce step by step, so cannot prove lossless: what they do.
UNPROVEN = {
    "guidance_scale": "classifier-free guidance runs the model a second time on an unconditional prompt",
    "max_time": "a wall-clock stop makes the output depend on the machine's speed",
    "token_healing": "token healing rewrites the prompt's last tokens with the tokenizer",
}


def refuse_unproven(gc: GenerationConfig) -> None:
    """ConfigError for a decoding mode other than greedy search or sampling (contrastive search,
    DoLa, ...) and for the options in UNPROVEN: hippo decodes token by token with the target's own
    logits processors, which is lossless for greedy search and sampling only."""
    from transformers.generation.configuration_utils import GenerationMode

    defaults = {"guidance_scale": (None, 1, 1.0), "max_time": (None,), "token_healing": (None, False)}
    for field, why in UNPROVEN.items():
        value = getattr(gc, field, None)
        if value not in defaults[field]:
            raise ConfigError(
                f"generation option {field}={value!r} cannot be kept lossless ({why}); remove it"
            )
    try:
        mode = gc.get_generation_mode()
    except ValueError as exc:
        raise ConfigError(f"bad generation settings: {exc}") from exc
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise ConfigError(
            f"these generation settings select {mode.value.replace('_', ' ')}, which hippo cannot keep "
            "lossless: it decodes by greedy search or sampling (set do_sample, and leave penalty_alpha, "
            "dola_layers and the beam options unset)"
        )


class TokenPolicy:
    """Processes logits, turns them into probabilities, picks tokens (argmax or seeded sampling)."""

    def __init__(
        self,
        processors: LogitsProcessorList,
        do_sample: bool,
        generator: torch.Generator,
        vocab_size: int | None = None,  # the target's V; draft logits are fitted to it
        device: torch.device | None = None,  # where the processors' tensors live (None: any)
    ):
        self.processors = processors
        self._chain = _Chain.of(processors)
        self.do_sample = bool(do_sample)
        self.generator = generator
        self.vocab_size = vocab_size
        self.device = device

    def fork(self) -> TokenPolicy:
        """The same rules with a generator of its own, seeded by one draw from this one.

        For a draft on another thread or process: the two sides never share a random generator,
        and a seeded run stays reproducible. The result pickles (the generator's state travels).
        """
        seed = int(torch.randint(2**62, (), generator=self.generator))
        return TokenPolicy(
            self.processors, self.do_sample, torch.Generator().manual_seed(seed), self.vocab_size, self.device
        )

    def fit(self, logits: torch.Tensor) -> torch.Tensor:  # [..., V_q] -> [..., V_p]
        """Draft logits over the target's vocabulary: padding rows (one side only) get -inf."""
        v = self.vocab_size
        if v is None or logits.shape[-1] == v:
            return logits
        if logits.shape[-1] > v:
            return logits[..., :v]
        pad = logits.new_full((*logits.shape[:-1], v - logits.shape[-1]), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    @classmethod
    def for_model(
        cls,
        model: Any,
        gc: GenerationConfig,
        prompt_ids: torch.Tensor,  # [L]
        generator: torch.Generator,
    ) -> TokenPolicy:
        device = model.device  # generate() builds its processors where the logits are
        ids = prompt_ids[None].to(device)
        # as generate() does first: the eos/pad/bos tensors that min_new_tokens, min_length and other
        # eos-aware processors read (without them those processors are silently left out)
        model._prepare_special_tokens(gc, True, device=device)
        processors = model._get_logits_processor(
            generation_config=gc,
            input_ids_seq_length=ids.shape[1],
            encoder_input_ids=ids,
            prefix_allowed_tokens_fn=None,
            logits_processor=LogitsProcessorList(),
            device=device,
            model_kwargs={"attention_mask": torch.ones_like(ids)},
        )
        return cls(processors, gc.do_sample, generator, model.get_output_embeddings().weight.shape[0], device)

    def process(
        self,
        seq: torch.Tensor,  # [T'] long: the sequence the last row conditions on
        logits: torch.Tensor,  # [k, V] raw logits; row i predicts the token after seq[: T' - k + 1 + i]
    ) -> torch.Tensor:  # [k, V] processed scores, float32 like generate()'s
        # generate() casts each step's logits to float32 before its processors and its argmax; doing
        # the same keeps near-ties resolved identically whatever the model's dtype.
        logits = logits.float()
        if not self.processors:
            return logits
        if self.device is not None:  # the processors' tensors (eos ids, ...) live on the model's device
            logits = logits.to(self.device)
        k, start = logits.shape[0], seq.shape[0] - logits.shape[0] + 1
        seq = seq.to(logits.device)
        apply = self.processors if self._chain is None else self._chain
        rows = [apply(seq[None, : start + i], logits[i : i + 1].clone()) for i in range(k)]
        return torch.cat(rows, dim=0)

    @staticmethod
    def probs(scores: torch.Tensor) -> torch.Tensor:  # [k, V] -> [k, V]
        return torch.softmax(scores.double(), dim=-1)

    def distribution(self, scores: torch.Tensor) -> torch.Tensor:  # [k, V] -> [k, V] float64
        """The law the next token is drawn from: softmax when sampling, one-hot argmax when greedy."""
        if self.do_sample:
            return self.probs(scores)
        return torch.nn.functional.one_hot(scores.argmax(-1), scores.shape[-1]).double()

    def choose(self, scores: torch.Tensor) -> int:  # scores [V] processed
        """The token `generate` would emit from these scores (argmax, or a seeded sample)."""
        if not self.do_sample:
            return int(torch.argmax(scores))
        return self.sample(self.probs(scores[None])[0])

    def draft_token(
        self,
        seq: torch.Tensor,  # [T'] the sequence the draft token follows
        logits: torch.Tensor,  # [V_q] q's raw logits after `seq`
    ) -> tuple[int, torch.Tensor | None]:
        """q's next token, processed as p's are: drawn from q's law when sampling (the law [V_p]
        returned, for the rejection test), else q's argmax (None). One place for every drafter."""
        scores = self.process(seq, self.fit(logits)[None])  # [1, V_p]
        if self.do_sample:
            q = self.probs(scores)[0]
            return self.sample(q), q
        return int(scores[0].argmax()), None

    def sample(self, probs: torch.Tensor) -> int:  # probs [V]
        return int(torch.multinomial(probs.cpu(), 1, generator=self.generator))

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.generator, dtype=torch.float64))


class _Chain:
    """The processors applied in order, as `LogitsProcessorList.__call__` applies them, for processors
    that each take just (input_ids, scores): the list itself inspects every processor's signature
    on every call (28 us of a min_new_tokens step's 39, 72 us of a repetition penalty's 115), and
    a round calls it once per scored position. A class, so that a policy still pickles."""

    def __init__(self, processors: LogitsProcessorList):
        self.processors = list(processors)

    @classmethod
    def of(cls, processors: LogitsProcessorList) -> _Chain | None:
        """None where a processor wants more arguments (the list then says which)."""
        if any(len(inspect.signature(p.__call__).parameters) > 2 for p in processors):
            return None
        return cls(processors)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:  # [1, T], [1, V]
        for p in self.processors:
            scores = p(input_ids, scores)
        return scores


#: Draft and target vocabularies may differ only by embedding padding (e.g. 151936 vs 152064 rows).
PADDING_SHARE = 0.99


def check_vocab(target_size: int, draft_size: int) -> None:
    """Raise ModelError unless the two vocabulary sizes are equal or differ only by padding."""
    small, large = sorted((int(target_size), int(draft_size)))
    if small != large and small < PADDING_SHARE * large:
        raise ModelError(
            f"draft vocabulary ({draft_size}) differs from the target's ({target_size}); speculative "
            "decoding needs a draft that shares the target's tokenizer"
        )


def make_generator(seed: int | None, generator: torch.Generator | None) -> torch.Generator:
    if generator is not None:
        if seed is not None:
            raise ConfigError("pass either seed or generator, not both")
        return generator
    g = torch.Generator(device="cpu")
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed))
    return g

"""video-SALMONN 2+ built from transformers' pieces: Qwen2.5-VL (vision + LLM), Whisper's encoder, a
window Q-Former made of Blip-2 Q-Former leaf modules, and a linear projector.

Layout of the modules (and of the released checkpoints' keys, which load without any renaming
beyond transformers' own Qwen2.5-VL remap `visual.` -> `model.visual.`, `model.` ->
`model.language_model.`):

    model.visual.*, model.language_model.*, lm_head   stock `Qwen2_5_VLModel` + head
    audio.{conv1, conv2, embed_positions, layers.N, layer_norm}   stock `WhisperEncoder` (subclassed)
    audio.qformer.bert.embeddings.LayerNorm                        LayerNorm on the query tokens
    audio.qformer.bert.encoder.layer.N.{attention, crossattention}.self.{query, key, value}
    audio.qformer.bert.encoder.layer.N.{attention, crossattention}.output.{dense, LayerNorm}
    audio.qformer.bert.encoder.layer.N.{intermediate_query.dense, output_query.{dense, LayerNorm}}
    audio.q_tokens [1, 1, H_q], audio.audio_proj  Linear(H_q -> LLM hidden)

The Q-Former leaves are transformers' `Blip2QFormerMultiHeadAttention` (query/key/value),
`Blip2QFormerSelfOutput`, `Blip2QFormerIntermediate` and `Blip2QFormerOutput`; only the BERT-named
containers around them (`attention.self`, `embeddings.LayerNorm`) are written here, because
`Blip2QFormerModel` names them `attention.attention` and `layernorm`.

Audio path: 16 kHz mono -> Whisper log-mel features, one [mel, chunk·100] block per `chunk_length`
seconds (30 s: 128 x 3000) -> encoder (chunk·50 frames) -> non-overlapping windows of
`second_per_window` seconds (25 frames) -> Q-Former (1 query per window, cross-attending to the
window) -> projector: 2 audio tokens per second, `ceil(dur / chunk) * 60` tokens for 30 s chunks.

Positions: `config.positions` chooses the M-RoPE layout ("released", the default, or "training"); see
`hippo.adapters.video_salmonn2_plus_positions`. `generate` computes them itself, so the class's own
autoregressive decode is the reference that hippo's output must equal.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import (
    AutoConfig,
    BertConfig,
    PreTrainedConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    WhisperConfig,
    WhisperFeatureExtractor,
)
from transformers import initialization as init
from transformers.conversion_mapping import (
    get_checkpoint_conversion_mapping,
    register_checkpoint_conversion_mapping,
)
from transformers.models.blip_2.configuration_blip_2 import Blip2QFormerConfig
from transformers.models.blip_2.modeling_blip_2 import (
    Blip2QFormerIntermediate,
    Blip2QFormerMultiHeadAttention,
    Blip2QFormerOutput,
    Blip2QFormerSelfOutput,
)
from transformers.models.whisper.modeling_whisper import WhisperEncoder

from hippo.adapters.video_salmonn2_plus_positions import POSITION_MODES, mrope_positions
from hippo.compat import cache_arg
from hippo.errors import InputError

SAMPLE_RATE = 16000
HOP_LENGTH = 160  # mel frames per second = 100; the encoder halves them (conv2 stride 2): 50 per second
AUDIO_TYPE = 3  # mm_token_type_ids value of audio placeholders (0 text, 1 image, 2 video)


# ---- configs ------------------------------------------------------------------------------------


@strict
class VideoSalmonn2PlusQFormerConfig(BertConfig):
    """The window Q-Former (a BERT config, as released), with video-SALMONN 2+'s defaults."""

    hidden_size: int = 3072
    num_hidden_layers: int = 2
    num_attention_heads: int = 12
    intermediate_size: int = 12288
    layer_norm_eps: float = 1e-12
    add_cross_attention: bool = True
    encoder_width: int = 1280  # width of the Whisper features the queries cross-attend to
    cross_attention_freq: int = 1  # cross-attention in every layer
    query_length: int = 1  # queries per window
    out_hidden_size: int | None = None  # the LLM hidden size; set by the parent config


@strict
class VideoSalmonn2PlusAudioConfig(WhisperConfig):
    """The Whisper-large-v3 encoder plus windowing; `qformer_config` nests the Q-Former's BERT config.

    `chunk_length` (seconds per encoder call) is not in the released config: it is Whisper's fixed
    30 s there. Tiny test configs shrink it (and `max_source_positions` = 50 · chunk_length with it)
    so that the rates, 100 mel frames and 50 encoder frames per second, stay the real ones.
    """

    sub_configs_defaults = {"qformer_config": VideoSalmonn2PlusQFormerConfig}

    num_mel_bins: int = 128
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    d_model: int = 1280
    max_source_positions: int = 1500
    activation_function: str = "gelu"
    second_per_window: float | int = 0.5
    second_stride: float | int = 0.5
    chunk_length: int = 30
    qformer_config: dict | PreTrainedConfig | None = None


@strict
class VideoSalmonn2PlusConfig(Qwen2_5_VLConfig):
    """Qwen2.5-VL's config plus `audio_config`, `audio_token_id` and the M-RoPE layout `positions`.

    The released config.json says model_type "qwen2_5_vl" and keeps the text settings flat; both load
    into this class. `positions`: "released" (default: the behaviour of the released inference
    code, with which the published checkpoints were evaluated) or "training" (the audio-visual
    positions the training data pipeline computes).
    """

    model_type = "video_salmonn2_plus"
    sub_configs_defaults = {
        **Qwen2_5_VLConfig.sub_configs_defaults,
        "audio_config": VideoSalmonn2PlusAudioConfig,
    }

    audio_config: dict | PreTrainedConfig | None = None
    audio_token_id: int = 151665
    positions: str = "released"

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.positions not in POSITION_MODES:
            raise ValueError(f"positions must be one of {POSITION_MODES}, got {self.positions!r}")
        # as released: the projector maps the Q-Former's width onto the LLM's
        self.audio_config.qformer_config.out_hidden_size = self.text_config.hidden_size


# ---- the window Q-Former (BERT names around Blip-2 leaves) --------------------------------------


def blip2_qformer_config(audio: VideoSalmonn2PlusAudioConfig) -> Blip2QFormerConfig:
    q = audio.qformer_config
    return Blip2QFormerConfig(
        hidden_size=q.hidden_size,
        num_hidden_layers=q.num_hidden_layers,
        num_attention_heads=q.num_attention_heads,
        intermediate_size=q.intermediate_size,
        hidden_act=q.hidden_act,
        hidden_dropout_prob=q.hidden_dropout_prob,
        attention_probs_dropout_prob=q.attention_probs_dropout_prob,
        layer_norm_eps=q.layer_norm_eps,
        encoder_hidden_size=q.encoder_width,
        cross_attention_frequency=q.cross_attention_freq,
        attn_implementation="eager",
    )


class _BertAttention(nn.Module):
    """BERT's attention block under BERT's names: `self` (query/key/value) then `output` (post-LN)."""

    def __init__(self, config: Blip2QFormerConfig, cross: bool):
        super().__init__()
        self.self = Blip2QFormerMultiHeadAttention(config, is_cross_attention=cross)
        self.output = Blip2QFormerSelfOutput(config)

    def forward(self, hidden: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        out, _ = self.self(hidden, encoder_hidden_states=context)  # [B, q, H]
        return self.output(out, hidden)


class _QFormerLayer(nn.Module):
    """Self-attention over the queries, cross-attention to the window, then the query FFN."""

    def __init__(self, config: Blip2QFormerConfig, index: int):
        super().__init__()
        self.attention = _BertAttention(config, cross=False)
        if index % config.cross_attention_frequency == 0:
            self.crossattention = _BertAttention(config, cross=True)
        self.intermediate_query = Blip2QFormerIntermediate(config)
        self.output_query = Blip2QFormerOutput(config)

    def forward(self, hidden: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        hidden = self.attention(hidden)
        if hasattr(self, "crossattention"):
            hidden = self.crossattention(hidden, context)
        return self.output_query(self.intermediate_query(hidden), hidden)


class _QFormerEncoder(nn.Module):
    def __init__(self, config: Blip2QFormerConfig):
        super().__init__()
        self.layer = nn.ModuleList(_QFormerLayer(config, i) for i in range(config.num_hidden_layers))


class _QFormerEmbeddings(nn.Module):
    """Only the LayerNorm is left of BERT's embeddings: queries come in as embeddings."""

    def __init__(self, config: Blip2QFormerConfig):
        super().__init__()
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)


class _QFormerBert(nn.Module):
    def __init__(self, config: Blip2QFormerConfig):
        super().__init__()
        self.embeddings = _QFormerEmbeddings(config)
        self.encoder = _QFormerEncoder(config)

    def forward(self, queries: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        # queries [B, q, H], context [B, k, encoder_width] -> [B, q, H]
        hidden = self.embeddings.dropout(self.embeddings.LayerNorm(queries))
        for layer in self.encoder.layer:
            hidden = layer(hidden, context)
        return hidden


class WindowQFormer(nn.Module):
    def __init__(self, config: Blip2QFormerConfig):
        super().__init__()
        self.bert = _QFormerBert(config)


# ---- audio encoder ------------------------------------------------------------------------------


def window_frames(audio_config: Any) -> tuple[int, int]:
    """(window, stride) in encoder frames: round(50 · seconds); (25, 25) for 0.5 s windows."""
    per_second = audio_config.max_source_positions / audio_config.chunk_length  # 50
    return round(per_second * audio_config.second_per_window), round(per_second * audio_config.second_stride)


def tokens_per_chunk(audio_config: Any) -> int:
    """Audio tokens per chunk: one per window and query (60 for 30 s chunks)."""
    window, stride = window_frames(audio_config)
    return (
        (audio_config.max_source_positions - window) // stride + 1
    ) * audio_config.qformer_config.query_length


class VideoSalmonn2PlusAudioEncoder(WhisperEncoder):
    """transformers' `WhisperEncoder` (its `forward` unchanged) holding the Q-Former and projector."""

    config: VideoSalmonn2PlusAudioConfig
    # a buffer of BERT's embeddings that some checkpoints carry; nothing here uses it
    _keys_to_ignore_on_load_unexpected = [r"qformer\.bert\.embeddings\.position_ids"]

    def __init__(self, config: VideoSalmonn2PlusAudioConfig):
        super().__init__(config)
        if round(config.chunk_length * 50) != config.max_source_positions:
            raise ValueError(
                f"audio_config.max_source_positions ({config.max_source_positions}) must be 50 x chunk_length "
                f"({config.chunk_length} s): Whisper makes 50 encoder frames per second"
            )
        q = blip2_qformer_config(config)
        self.window, self.stride = window_frames(config)
        self.qformer = WindowQFormer(q)
        self.q_tokens = nn.Parameter(torch.zeros(1, config.qformer_config.query_length, q.hidden_size))
        out = config.qformer_config.out_hidden_size or q.hidden_size
        self.audio_proj = nn.Linear(q.hidden_size, out)
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, VideoSalmonn2PlusAudioEncoder):
            init.normal_(module.q_tokens, mean=0.0, std=self.config.qformer_config.initializer_range)

    @property
    def tokens_per_chunk(self) -> int:
        return tokens_per_chunk(self.config)

    def audio_tokens(self, features: torch.Tensor) -> torch.Tensor:
        # features [n_chunks, mel, 100·chunk] -> [n_chunks, tokens_per_chunk, D]
        hidden = self(features.to(self.conv1.weight.dtype)).last_hidden_state  # [n, F, C] F = 50·chunk
        n, _, width = hidden.shape
        windows = hidden.unfold(1, self.window, self.stride)  # [n, n_win, C, window]
        n_win = windows.shape[1]
        windows = windows.permute(0, 1, 3, 2).reshape(n * n_win, self.window, width)  # [n·n_win, window, C]
        queries = self.q_tokens.expand(n * n_win, -1, -1)  # [n·n_win, q, H]
        out = self.qformer.bert(queries, windows)  # [n·n_win, q, H]
        return self.audio_proj(out.reshape(n, n_win * out.shape[1], -1))  # [n, tokens_per_chunk, D]


def audio_token_count(seconds: float, audio_config: Any) -> int:
    """Audio tokens for a clip of `seconds`: ceil(max(dur, 1 s) / chunk) chunks, padded tail included."""
    samples = max(round(seconds * SAMPLE_RATE), SAMPLE_RATE)
    return math.ceil(samples / (audio_config.chunk_length * SAMPLE_RATE)) * tokens_per_chunk(audio_config)


def audio_inputs(waveform: torch.Tensor, audio_config: Any, dtype: torch.dtype = torch.float32) -> dict:
    """Processor-shaped audio inputs from a 16 kHz mono waveform [S].

    As released: under 1 s is zero-padded to 1 s, then cut into `chunk_length` pieces that Whisper's
    feature extractor pads to a full chunk each. Returns `audio_feature` [n_chunks, mel, 100·chunk]
    and `audio_lengths` [1] (this clip's audio token count, which the prompt must hold).
    """
    wav = torch.as_tensor(waveform).detach().to("cpu", torch.float32).reshape(-1)  # [S]
    if wav.numel() == 0:
        raise InputError("the audio waveform is empty; this backbone needs the video's audio track")
    if wav.numel() < SAMPLE_RATE:
        wav = torch.nn.functional.pad(wav, (0, SAMPLE_RATE - wav.numel()))
    piece = audio_config.chunk_length * SAMPLE_RATE
    pieces = [wav[i : i + piece].numpy() for i in range(0, wav.numel(), piece)]
    extractor = WhisperFeatureExtractor(
        feature_size=audio_config.num_mel_bins,
        sampling_rate=SAMPLE_RATE,
        hop_length=HOP_LENGTH,
        chunk_length=audio_config.chunk_length,
    )
    feats = extractor(pieces, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
    feats = feats.to(dtype)  # [n_chunks, mel, 100·chunk]
    n_tokens = len(pieces) * tokens_per_chunk(audio_config)
    return {"audio_feature": feats, "audio_lengths": torch.tensor([n_tokens])}


# ---- the model ----------------------------------------------------------------------------------


class VideoSalmonn2PlusForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """video-SALMONN 2+: stock Qwen2.5-VL plus `audio` (Whisper encoder, window Q-Former, projector).

    Extra forward inputs: `audio_feature` [n_chunks, mel, frames] and `audio_lengths` [n_clips]
    (audio tokens per clip); the audio embeddings replace the `audio_token_id` placeholders in order.
    Position ids are computed here (never by Qwen2.5-VL's own `get_rope_index`).
    """

    config_class = VideoSalmonn2PlusConfig
    config: VideoSalmonn2PlusConfig

    def __init__(self, config: VideoSalmonn2PlusConfig):
        super().__init__(config)
        self.audio = VideoSalmonn2PlusAudioEncoder._from_config(config.audio_config)
        self._rope_delta: int | None = None
        self.post_init()

    # ---- encoders ----
    def get_audio_features(
        self, audio_feature: torch.Tensor, audio_lengths: torch.Tensor | None = None
    ) -> torch.Tensor:  # audio_feature [n_chunks, mel, frames] -> [A, D]
        if audio_feature.dim() != 3 or audio_feature.shape[1] != self.config.audio_config.num_mel_bins:
            raise InputError(
                f"audio_feature must have shape [n_chunks, {self.config.audio_config.num_mel_bins}, frames], "
                f"got {tuple(audio_feature.shape)}; build it with `audio_inputs(waveform, config.audio_config)`"
            )
        tokens = self.audio.audio_tokens(audio_feature).flatten(0, 1)  # [A, D]
        if audio_lengths is not None and int(audio_lengths.sum()) != tokens.shape[0]:
            raise InputError(
                f"audio_lengths says {int(audio_lengths.sum())} audio tokens but audio_feature encodes to "
                f"{tokens.shape[0]} ({audio_feature.shape[0]} chunks x {self.audio.tokens_per_chunk})"
            )
        return tokens

    def embed_prompt(
        self,
        input_ids: torch.Tensor,  # [B, L]
        audio_feature: torch.Tensor | None = None,
        audio_lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # -> inputs_embeds [B, L, D] (audio in), audio [A, D]
        embeds = self.get_input_embeddings()(input_ids)  # [B, L, D]
        mask = input_ids == self.config.audio_token_id  # [B, L]
        n = int(mask.sum())
        if audio_feature is None:
            if n:
                raise InputError(
                    f"the prompt has {n} audio placeholders (<|audio_pad|>) but no audio_feature was given; "
                    "pass the audio of the video (audio_inputs(waveform, config.audio_config)) or build the "
                    "prompt without audio"
                )
            return embeds, None
        audio = self.get_audio_features(audio_feature, audio_lengths).to(embeds.dtype)  # [A, D]
        if audio.shape[0] != n:
            raise InputError(
                f"the prompt has {n} audio placeholders but the audio encodes to {audio.shape[0]} tokens; "
                "build input_ids and audio_feature from the same clip"
            )
        return embeds.masked_scatter(mask[..., None], audio), audio

    def mrope_positions(
        self,
        input_ids: torch.Tensor,  # [B, L]
        video_grid_thw: torch.Tensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:  # -> [3, B, L]
        if attention_mask is not None and not bool(attention_mask.all()):
            raise InputError("video-SALMONN 2+ positions are computed for unpadded prompts only")
        rows = [
            mrope_positions(ids, self.config, video_grid_thw, second_per_grid_ts, self.config.positions)
            for ids in input_ids
        ]
        return torch.stack(rows, dim=1).to(input_ids.device)

    # ---- forward and generate ----
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        pixel_values: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        image_grid_thw: torch.LongTensor | None = None,
        video_grid_thw: torch.LongTensor | None = None,
        mm_token_type_ids: torch.IntTensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
        audio_feature: torch.Tensor | None = None,
        audio_lengths: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ):
        if pixel_values is not None:
            raise InputError("video-SALMONN 2+ takes videos (pixel_values_videos), not images")
        # transformers 5.24 renamed the argument (`hippo.compat`): generate() passes `cache` there,
        # `past_key_values` before; either is read, and passed on under this release's name
        cache = kwargs.pop("cache", None)
        cache = past_key_values if cache is None else cache
        past = 0 if cache is None else cache.get_seq_length()
        if inputs_embeds is None and input_ids is not None and (past == 0 or audio_feature is not None):
            inputs_embeds, _ = self.embed_prompt(input_ids, audio_feature, audio_lengths)
        if position_ids is None and input_ids is not None:
            if past == 0:
                position_ids = self.mrope_positions(
                    input_ids, video_grid_thw, second_per_grid_ts, attention_mask
                )
                self._rope_delta = int(position_ids[0, 0, -1]) + 1 - input_ids.shape[1]
            elif self._rope_delta is not None:  # continue after the prompt: last position + 1
                step = torch.arange(past, past + input_ids.shape[1], device=input_ids.device)
                position_ids = (step + self._rope_delta).view(1, 1, -1).expand(3, input_ids.shape[0], -1)
        return super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **cache_arg(cache),
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
            pixel_values_videos=pixel_values_videos,
            video_grid_thw=video_grid_thw,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )

    def prepare_inputs_for_generation(
        self, *args: Any, is_first_iteration: bool | None = False, **kwargs: Any
    ):
        inputs = super().prepare_inputs_for_generation(*args, is_first_iteration=is_first_iteration, **kwargs)
        if not is_first_iteration and kwargs.get("use_cache", True):  # the audio is in the cache already
            inputs.pop("audio_feature", None)
            inputs.pop("audio_lengths", None)
        return inputs

    def _prepare_position_ids_for_generation(self, inputs_tensor, model_kwargs):
        # [4, B, L]: 1-D text positions (for the mask) then the 3 M-RoPE rows; generate() continues
        # every row with last + 1, which is where decoding continues in both layouts
        text = super(Qwen2_5_VLForConditionalGeneration, self)._prepare_position_ids_for_generation(
            inputs_tensor, model_kwargs
        )
        ids = model_kwargs.get("input_ids")
        if ids is None or ids.shape[1] == 0:
            ids = inputs_tensor
        if ids.dim() != 2 or ids.dtype not in (torch.int, torch.long):
            return torch.cat([text[None], text[None].expand(3, -1, -1)], dim=0)
        rope = self.mrope_positions(
            ids,
            model_kwargs.get("video_grid_thw"),
            model_kwargs.get("second_per_grid_ts"),
            model_kwargs.get("attention_mask"),
        )
        return torch.cat([text[None].to(rope.device), rope], dim=0)


# The released checkpoints use the 4.x Qwen2.5-VL key layout; transformers' own remap for the stock
# class is looked up by class name, so the subclass registers the same remap (audio.* needs none).
register_checkpoint_conversion_mapping(
    VideoSalmonn2PlusForConditionalGeneration.__name__,
    get_checkpoint_conversion_mapping("Qwen2_5_VLForConditionalGeneration"),
    overwrite=True,
)
AutoConfig.register(VideoSalmonn2PlusConfig.model_type, VideoSalmonn2PlusConfig, exist_ok=True)

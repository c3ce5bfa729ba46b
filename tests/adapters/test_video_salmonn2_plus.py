"""video-SALMONN 2+: the model class, its checkpoint layout, the audio path, positions and the adapter.

Float64 tiny models on CPU. The reference for losslessness is the class's own `generate`.
"""

from __future__ import annotations

import json
import wave

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration
from transformers.models.blip_2.modeling_blip_2 import Blip2QFormerModel
from transformers.models.whisper.modeling_whisper import WhisperEncoder

import hippo
from hippo.adapters.qwen2_5_vl_tiny import tiny_config as qwen_tiny_config
from hippo.adapters.video_salmonn2_plus import VideoSalmonn2PlusAdapter
from hippo.adapters.video_salmonn2_plus_model import (
    VideoSalmonn2PlusAudioConfig,
    VideoSalmonn2PlusConfig,
    VideoSalmonn2PlusForConditionalGeneration,
    audio_inputs,
    audio_token_count,
    blip2_qformer_config,
)
from hippo.adapters.video_salmonn2_plus_positions import audio_split, clip_ids, mrope_positions
from hippo.adapters.video_salmonn2_plus_tiny import AUDIO, synthetic_inputs, tiny_config, tiny_model
from hippo.compat import CACHE_ARG
from hippo.errors import ConfigError, InputError
from hippo.media.video import read_audio
from hippo.registry import resolve_adapter

F64 = torch.float64
_MODELS: dict = {}


def model(role: str = "target", positions: str = "released", seed: int | None = None):
    seed = (0 if role == "target" else 1) if seed is None else seed
    key = (role, positions, seed)
    if key not in _MODELS:
        _MODELS[key] = tiny_model(role, seed=seed, dtype=F64, positions=positions)
    return _MODELS[key]


def video(t: int = 6, h: int = 56, w: int = 84, seed: int = 0) -> torch.Tensor:
    return torch.rand(t, h, w, 3, dtype=F64, generator=torch.Generator().manual_seed(seed))


def prompt(m, t: int = 6, audio=None, seed: int = 0) -> dict:
    return synthetic_inputs(m, video(t, seed=seed), [1, 10, 11], [13, 14, 15], audio)


# ---- checkpoints --------------------------------------------------------------------------------


def released_audio_tensors(cfg: VideoSalmonn2PlusConfig, g: torch.Generator) -> dict[str, torch.Tensor]:
    """The fact sheet's Q-Former / query / projector keys (§4), with the tiny config's shapes."""
    a, q = cfg.audio_config, cfg.audio_config.qformer_config
    H, F, W, D = q.hidden_size, q.intermediate_size, q.encoder_width, cfg.text_config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "audio.q_tokens": (1, 1, H),
        "audio.audio_proj.weight": (D, H),
        "audio.audio_proj.bias": (D,),
        "audio.qformer.bert.embeddings.LayerNorm.weight": (H,),
        "audio.qformer.bert.embeddings.LayerNorm.bias": (H,),
    }
    for i in range(q.num_hidden_layers):
        p = f"audio.qformer.bert.encoder.layer.{i}"
        for block, kv in (("attention", H), ("crossattention", W)):
            for name, fan_in in (("query", H), ("key", kv), ("value", kv)):
                shapes[f"{p}.{block}.self.{name}.weight"] = (H, fan_in)
                shapes[f"{p}.{block}.self.{name}.bias"] = (H,)
            shapes[f"{p}.{block}.output.dense.weight"] = (H, H)
            shapes[f"{p}.{block}.output.dense.bias"] = (H,)
            shapes[f"{p}.{block}.output.LayerNorm.weight"] = (H,)
            shapes[f"{p}.{block}.output.LayerNorm.bias"] = (H,)
        shapes[f"{p}.intermediate_query.dense.weight"] = (F, H)
        shapes[f"{p}.intermediate_query.dense.bias"] = (F,)
        shapes[f"{p}.output_query.dense.weight"] = (H, F)
        shapes[f"{p}.output_query.dense.bias"] = (H,)
        shapes[f"{p}.output_query.LayerNorm.weight"] = (H,)
        shapes[f"{p}.output_query.LayerNorm.bias"] = (H,)
    out = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    # Whisper's encoder under `audio.`: the sheet says these names are HF `WhisperEncoder`'s
    whisper = WhisperEncoder(a).state_dict()
    out.update({f"audio.{k}": torch.randn(v.shape, generator=g) for k, v in whisper.items()})
    return out


def write_released_checkpoint(path) -> dict[str, torch.Tensor]:
    """A tiny checkpoint in the released layout: 4.x key names and a flat 4.51-style config.json."""
    g = torch.Generator().manual_seed(7)
    cfg = tiny_config("target")
    stock = Qwen2_5_VLForConditionalGeneration(qwen_tiny_config("target")).state_dict()
    tensors = {}
    for k, v in stock.items():
        k = k.replace("model.visual.", "visual.").replace("model.language_model.", "model.")
        tensors[k] = torch.randn(v.shape, generator=g)
    tensors.update(released_audio_tensors(cfg, g))
    written = dict(tensors)
    tensors["audio.qformer.bert.embeddings.position_ids"] = torch.arange(512)[None]  # ignored buffer
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    text = cfg.text_config
    audio = cfg.audio_config.to_dict()
    audio["model_type"] = "whisper"
    audio["qformer_config"] = {**cfg.audio_config.qformer_config.to_dict(), "model_type": "bert"}
    config = {
        "architectures": ["video_SALMONN2_plus"],
        "model_type": "qwen2_5_vl",
        "torch_dtype": "float32",
        "vocab_size": text.vocab_size,
        "hidden_size": text.hidden_size,
        "intermediate_size": text.intermediate_size,
        "num_hidden_layers": text.num_hidden_layers,
        "num_attention_heads": text.num_attention_heads,
        "num_key_value_heads": text.num_key_value_heads,
        "max_position_embeddings": text.max_position_embeddings,
        "rms_norm_eps": text.rms_norm_eps,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": text.rope_parameters["mrope_section"]},
        "tie_word_embeddings": False,
        "vision_config": {**cfg.vision_config.to_dict(), "model_type": "qwen2_5_vl"},
        "audio_config": audio,
        "image_token_id": cfg.image_token_id,
        "video_token_id": cfg.video_token_id,
        "vision_start_token_id": cfg.vision_start_token_id,
        "vision_end_token_id": cfg.vision_end_token_id,
        "audio_token_id": AUDIO,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps(config))
    return written


def test_released_layout_checkpoint_loads(tmp_path):
    written = write_released_checkpoint(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)  # what hippo's builder reads first
    assert resolve_adapter(config) is VideoSalmonn2PlusAdapter  # not the Qwen2.5-VL adapter
    m, info = VideoSalmonn2PlusForConditionalGeneration.from_pretrained(
        tmp_path, output_loading_info=True, dtype=F64
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    state = m.state_dict()
    to_model = {"visual.": "model.visual.", "model.": "model.language_model."}
    assert len(state) == len(written)
    for key, value in written.items():
        here = next((new + key[len(old) :] for old, new in to_model.items() if key.startswith(old)), key)
        assert torch.equal(state[here], value.to(F64)), key
    assert m.config.audio_token_id == AUDIO and m.config.audio_config.chunk_length == 2
    out = m.generate(**prompt(m, t=2), max_new_tokens=2, do_sample=False)
    assert out.shape[1] == prompt(m, t=2)["input_ids"].shape[1] + 2


@pytest.mark.parametrize("positions", ["released", "training"])
def test_save_pretrained_round_trip(tmp_path, positions):
    target, draft = model("target", positions), model("draft", positions)
    target.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "target" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert all(k.split(".")[0] in ("visual", "model", "lm_head", "audio") for k in keys)  # released layout
    assert not any(k.startswith("model.language_model.") for k in keys)
    inputs = prompt(target)
    ref = target.generate(**inputs, max_new_tokens=8, do_sample=False)
    pipe = (
        hippo.PipelineBuilder()
        .target(str(tmp_path / "target"), dtype=F64)
        .draft(str(tmp_path / "draft"), dtype=F64)
        .selector("uniform", keep_ratio=0.5)
        .scheduler("serial", gamma=3)
        .build()
    )
    assert type(pipe.target_adapter).name == "video_salmonn2_plus"
    assert pipe.target_adapter.positions == positions  # the option travels in config.json
    assert torch.equal(pipe.generate(inputs, max_new_tokens=8, do_sample=False).sequences, ref)


def test_qformer_matches_transformers_blip2_qformer():
    """The window Q-Former is Blip-2's Q-Former under BERT's names: same weights, same output."""
    audio = model().audio
    blip = Blip2QFormerModel(blip2_qformer_config(audio.config)).to(F64).eval()
    ours = audio.qformer.bert.state_dict()
    renamed = {
        k.replace("embeddings.LayerNorm", "layernorm").replace(".self.", ".attention."): v
        for k, v in ours.items()
    }
    missing, unexpected = blip.load_state_dict(renamed, strict=True)
    assert not missing and not unexpected
    g = torch.Generator().manual_seed(3)
    queries = torch.randn(5, 1, blip.config.hidden_size, dtype=F64, generator=g)
    window = torch.randn(5, 25, audio.config.d_model, dtype=F64, generator=g)
    with torch.no_grad():
        want = blip(query_embeds=queries, encoder_hidden_states=window).last_hidden_state
        got = audio.qformer.bert(queries, window)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


# ---- audio --------------------------------------------------------------------------------------


def write_wav(path, seconds: float, rate: int = 16000) -> None:
    n = round(seconds * rate)
    t = torch.arange(n, dtype=F64) / rate
    pcm = (0.3 * torch.sin(2 * torch.pi * 440 * t) * 32767).to(torch.int16)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.numpy().tobytes())


@pytest.mark.parametrize("seconds, chunks", [(0.4, 1), (2.0, 1), (4.6, 3)])
def test_wav_to_audio_tokens(tmp_path, seconds, chunks):
    """A 16 kHz WAV read by decord: ceil(max(dur, 1 s) / chunk) chunks, 2 tokens per second of chunk."""
    write_wav(tmp_path / "a.wav", seconds)
    wav = read_audio(tmp_path / "a.wav")  # [S] float32 mono 16 kHz
    m = model()
    a = m.config.audio_config  # tiny scaling: 2 s chunks of 4 tokens (real: 30 s, 60 tokens)
    inputs = audio_inputs(wav, a, F64)
    assert inputs["audio_feature"].shape == (chunks, 128, 200)
    assert int(inputs["audio_lengths"]) == chunks * 4 == audio_token_count(seconds, a)
    with torch.no_grad():
        tokens = m.get_audio_features(inputs["audio_feature"], inputs["audio_lengths"])
    assert tokens.shape == (chunks * 4, m.config.text_config.hidden_size)
    full = synthetic_inputs(m, video(4), [1], [2], audio=wav)
    assert int((full["input_ids"] == AUDIO).sum()) == chunks * 4
    assert int((full["mm_token_type_ids"] == 3).sum()) == chunks * 4


def test_real_default_audio_config():
    """The default config is the released one: 30 s chunks of 128 x 3000 mel frames, 60 tokens each."""
    cfg = VideoSalmonn2PlusConfig()
    a = cfg.audio_config
    assert (a.num_mel_bins, a.d_model, a.encoder_layers, a.max_source_positions, a.chunk_length) == (
        128,
        1280,
        32,
        1500,
        30,
    )
    q = a.qformer_config
    assert (q.hidden_size, q.num_hidden_layers, q.query_length, q.encoder_width) == (3072, 2, 1, 1280)
    assert q.out_hidden_size == cfg.text_config.hidden_size
    assert cfg.audio_token_id == 151665 and cfg.positions == "released"
    assert [audio_token_count(s, a) for s in (0.3, 30, 30.5, 61)] == [60, 60, 120, 180]
    feats = audio_inputs(torch.zeros(45 * 16000), VideoSalmonn2PlusAudioConfig())
    assert feats["audio_feature"].shape == (2, 128, 3000) and int(feats["audio_lengths"]) == 120


# ---- layout and positions -----------------------------------------------------------------------


def test_layout_interleaves_audio_after_each_step():
    m = model()
    inputs = prompt(m, t=6)  # 3 steps of 0.75 s = 2.25 s of audio -> 2 chunks = 8 tokens
    ids = inputs["input_ids"][0].tolist()
    cfg = m.config
    assert audio_split(8, 3, 0.75, 2.0) == [1, 2, 5]  # f(j) = floor(1.5 j) = 0, 1, 3; last: remainder
    block = ids[ids.index(cfg.vision_start_token_id) + 1 : ids.index(cfg.vision_end_token_id)]
    v, a = cfg.video_token_id, AUDIO
    assert block == [v] * 6 + [a] + [v] * 6 + [a] * 2 + [v] * 6 + [a] * 5


def _cfg():
    return tiny_config("target")


LAYOUT = [1, 10, 11, *clip_ids(_cfg(), 2, 4, 4, 1.0, 2.0), 20, 21]  # 2 steps of 2x2 video + 2 audio


def test_training_positions_by_hand():
    pos = mrope_positions(
        torch.tensor(LAYOUT), _cfg(), torch.tensor([[2, 4, 4]]), torch.tensor([1.0]), "training"
    )
    want = torch.tensor(
        [
            [0, 1, 2, 3, 4, 4, 4, 4, 4, 5, 6, 6, 6, 6, 6, 7, 8, 9, 10],
            [0, 1, 2, 3, 4, 4, 5, 5, 4, 4, 4, 4, 5, 5, 4, 4, 8, 9, 10],
            [0, 1, 2, 3, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 6, 7, 8, 9, 10],
        ]
    )  # video [4 + 2j, 4 + y, 4 + x]; audio k [4 + k, 4, 4 + k]; vision_end at max temporal (7) + 1
    assert torch.equal(pos, want)


def test_released_positions_by_hand():
    pos = mrope_positions(
        torch.tensor(LAYOUT), _cfg(), torch.tensor([[2, 4, 4]]), torch.tensor([0.75]), "released"
    )
    want = torch.tensor(
        [
            [0, 1, 2, 3, 4, 4, 4, 4, 6, 6, 6, 6, 7, 8, 9, 10, 11, 12, 13],
            [0, 1, 2, 3, 4, 4, 5, 5, 4, 4, 5, 5, 7, 8, 9, 10, 11, 12, 13],
            [0, 1, 2, 3, 4, 5, 4, 5, 4, 5, 4, 5, 7, 8, 9, 10, 11, 12, 13],
        ]
    )  # the 8 tokens from the first video pad get the 2x2x2 grid (s = 1 whatever second_per_grid_ts
    # says), audio included; the last 2 video, 2 audio, vision_end and text are 1-D from 7
    assert torch.equal(pos, want)


def test_training_positions_follow_the_formula():
    m = model("target", "training")
    inputs = prompt(m, t=6)
    enc = VideoSalmonn2PlusAdapter(m).encode(inputs)
    ids, pos = enc.input_ids, enc.positions
    base = int((ids == m.config.vision_start_token_id).nonzero()) + 1
    audio = (ids == AUDIO).nonzero().flatten()
    k = torch.arange(audio.numel())
    assert torch.equal(pos[:, audio], torch.stack([base + k, torch.full_like(k, base), base + k]))
    t, h, w = enc.visual.grids[0]
    j = torch.arange(t * h * w) // (h * w)
    r = torch.arange(t * h * w) % (h * w)
    temporal = (j * 0.75 * 2).floor().long()
    assert torch.equal(
        pos[:, enc.visual.seq_index], torch.stack([base + temporal, base + r // w, base + r % w])
    )
    end = int((ids == m.config.vision_end_token_id).nonzero())
    assert int(pos[0, end]) == max(int(temporal.max()), audio.numel() - 1) + base + 1
    assert enc.next_position == int(pos[0, -1]) + 1


# ---- the adapter --------------------------------------------------------------------------------


@pytest.mark.parametrize("positions", ["released", "training"])
def test_draft_prefill_gets_kept_video_all_audio_all_text(positions, monkeypatch):
    target = model("target", positions)
    adapter = VideoSalmonn2PlusAdapter(target)
    enc = adapter.encode(prompt(target))
    n, L = enc.visual.n, enc.length
    audio_rows = enc.extras["audio_index"]
    assert n > 4 and audio_rows.numel() == 8
    assert torch.equal(enc.input_ids[enc.visual.seq_index], torch.full((n,), target.config.video_token_id))
    keep = torch.tensor([0, 2, n - 1])
    seen = {}
    original = target.forward

    def spy(*args, **kwargs):
        if kwargs.get(CACHE_ARG) is not None and kwargs[CACHE_ARG].get_seq_length() == 0:
            seen.update(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(target, "forward", spy)
    session = adapter.prefill(enc, keep)
    monkeypatch.undo()
    assert session.cache.get_seq_length() == L - n + 3 and session.length == L
    rows = torch.ones(L, dtype=torch.bool)
    rows[enc.visual.seq_index] = False
    rows[enc.visual.seq_index[keep]] = True
    assert bool(rows[audio_rows].all())  # every audio token, never pruned
    assert torch.equal(seen["inputs_embeds"][0], enc.embeds[rows])
    pos = seen["position_ids"]
    assert torch.equal(pos.reshape(3, -1), enc.positions[:, rows])  # original positions
    with torch.no_grad():
        audio = target.get_audio_features(prompt(target)["audio_feature"])
    assert torch.equal(enc.embeds[audio_rows], audio) and torch.equal(enc.extras["audio"], audio)
    assert bool((session.positions(L, 1).reshape(-1) == enc.next_position).all())


SELECTORS = [("uniform", {"keep_ratio": 0.3}), ("random", {"keep_ratio": 0.3}), ("full", {})]


@pytest.mark.parametrize("positions", ["released", "training"])
@pytest.mark.parametrize("selector, options", SELECTORS, ids=[s for s, _ in SELECTORS])
@pytest.mark.parametrize("draft_role", ["self", "draft"])
def test_greedy_exact_against_the_class_generate(positions, selector, options, draft_role):
    target = model("target", positions)
    draft = target if draft_role == "self" else model("draft", positions)
    pipe = (
        hippo.PipelineBuilder()
        .target(target)
        .draft(draft)
        .selector(selector, **options)
        .scheduler("serial", gamma=3)
        .build()
    )
    for t, seed in ((6, 0), (3, 1), (1, 2), (5, 3)):  # 3, 2, 1 and 3 temporal steps
        inputs = prompt(target, t=t, seed=seed)
        ref = target.generate(**inputs, max_new_tokens=16, do_sample=False)
        out = pipe.generate(inputs, max_new_tokens=16, do_sample=False)
        assert torch.equal(out.sequences, ref), (t, out.sequences, ref)
    if draft_role == "self" and selector == "full":
        assert out.stats.acceptance_rate == 1.0  # same model, same tokens, same positions


@pytest.mark.parametrize("positions", ["released", "training"])
def test_video_without_audio_is_exact(positions):
    target, draft = model("target", positions), model("draft", positions)
    inputs = prompt(target, t=4, audio=False)
    assert "audio_feature" not in inputs and not bool((inputs["input_ids"] == AUDIO).any())
    ref = target.generate(**inputs, max_new_tokens=8, do_sample=False)
    pipe = hippo.PipelineBuilder().target(target).draft(draft).selector("uniform", keep_ratio=0.5).build()
    assert torch.equal(pipe.generate(inputs, max_new_tokens=8, do_sample=False).sequences, ref)


def test_audio_required_but_absent():
    target = model()
    inputs = prompt(target, t=2)
    del inputs["audio_feature"], inputs["audio_lengths"]
    pipe = hippo.PipelineBuilder().target(target).draft(target).selector("full").build()
    with pytest.raises(InputError, match="audio placeholders .* no audio_feature"):
        pipe.generate(inputs, max_new_tokens=2, do_sample=False)
    with pytest.raises(InputError, match="no audio_feature"):
        target.generate(**inputs, max_new_tokens=2, do_sample=False)


def test_audio_count_mismatch_and_bad_options():
    target = model()
    inputs = prompt(target, t=6)  # 8 audio tokens
    inputs["audio_feature"] = inputs["audio_feature"][:1]  # 4
    with pytest.raises(InputError, match="audio_lengths says 8"):
        VideoSalmonn2PlusAdapter(target).encode(inputs)
    del inputs["audio_lengths"]
    with pytest.raises(InputError, match="8 audio placeholders but the audio encodes to 4"):
        VideoSalmonn2PlusAdapter(target).encode(inputs)
    with pytest.raises(ConfigError, match="positions"):
        VideoSalmonn2PlusAdapter(target, positions="compact")
    with pytest.raises(ValueError, match="positions"):
        tiny_config("target", positions="compact")


def test_detection_leaves_plain_qwen_to_its_adapter():
    from hippo.adapters.qwen2_5_vl import Qwen25VLAdapter

    assert resolve_adapter(qwen_tiny_config("target")) is Qwen25VLAdapter
    assert resolve_adapter(tiny_config("target")) is VideoSalmonn2PlusAdapter
    released = AutoConfig.for_model("qwen2_5_vl", audio_config={"model_type": "whisper"})
    assert resolve_adapter(released) is VideoSalmonn2PlusAdapter  # the released config.json's shape


@pytest.mark.parametrize("positions", ["released", "training"])
def test_plain_forward_computes_positions_and_continues(positions):
    """forward() without position_ids, and hippo's target session, reproduce generate()'s logits."""
    m = model("target", positions)
    inputs = prompt(m, t=4)
    ref = m.generate(
        **inputs, max_new_tokens=2, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    with torch.no_grad():
        out = m(**inputs, use_cache=True)
        first = out.logits[0, -1]  # [V]
        step = m(input_ids=first.argmax().view(1, 1), past_key_values=out.past_key_values).logits[0, -1]
    # generate() keeps its logits in float32
    assert torch.equal(first.float(), ref.logits[0][0]) and torch.equal(step.float(), ref.logits[1][0])
    # and hippo's target session, prefilled from the adapter's encoding, is the same computation
    session = VideoSalmonn2PlusAdapter(m).prefill(VideoSalmonn2PlusAdapter(m).encode(inputs), None)
    assert torch.equal(session.last_logits.float(), ref.logits[0][0])
    assert torch.equal(session.forward(ref.sequences[0, -2:-1])[-1].float(), ref.logits[1][0])


def test_a_generated_audio_placeholder_is_decoded_as_a_token():
    """After the prompt, an `<|audio_pad|>` id the model itself generates is an ordinary token: the
    model reads the cache from `generate()` under either name (`cache` since transformers 5.24,
    `past_key_values` before), so a decode step is never taken for a prompt that lacks its audio."""
    m = model()
    inputs = prompt(m)
    L, audio = inputs["input_ids"].shape[1], m.config.audio_token_id
    vocab = list(range(m.config.text_config.vocab_size))

    def force(_batch: int, ids: torch.Tensor) -> list[int]:  # the audio id first, then anything
        return [audio] if ids.shape[-1] == L else vocab

    out = m.generate(**inputs, max_new_tokens=3, do_sample=False, prefix_allowed_tokens_fn=force)
    assert out[0, L] == audio and out.shape[1] == L + 3
